"""Writing other formats from a checkpoint: Hugging Face safetensors (:func:`export_safetensors`,
streaming, one rank or a process group), PyTorch DCP (:func:`export_dcp`) and Megatron-Core
``torch_dist`` (:func:`export_megatron`). See docs/interop.md."""

from .dcp_out import export_dcp
from .megatron_out import export_megatron
from .safetensors_out import export_safetensors, parse_size

__all__ = ["export_dcp", "export_megatron", "export_safetensors", "parse_size"]
