"""Writing other formats from a checkpoint: Hugging Face safetensors (:func:`export_safetensors`,
streaming, one rank or a process group) and PyTorch DCP (:func:`export_dcp`). See docs/interop.md."""

from .dcp_out import export_dcp
from .safetensors_out import export_safetensors, parse_size

__all__ = ["export_dcp", "export_safetensors", "parse_size"]
