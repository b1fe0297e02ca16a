__version__ = "0.2.0"  # 0.2: on-disk format 2 (small shards packed)
