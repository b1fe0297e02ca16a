__version__ = "0.3.0"  # 0.3: format 6 (plain tensors stored as tensors), the narrow public API (0.2 names deprecated)
