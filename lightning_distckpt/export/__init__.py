"""Export and conversion: one function per direction, each a single call on a checkpoint path.

Out of a checkpoint (anything :func:`lightning_distckpt.load` reads):

* :func:`to_safetensors`: the Hugging Face safetensors layout (streaming; one rank or a process group);
* :func:`to_dcp`: a PyTorch Distributed Checkpoint directory;
* :func:`to_megatron`: a Megatron-Core ``torch_dist`` directory;
* :func:`to_torch_file`: one ``torch.save`` file (a Lightning checkpoint as Lightning's own dict).

Into a checkpoint: :func:`from_torch_file` (any ``torch.save``'d dict). Between storage layouts:
:func:`relayout`. Each returns a :class:`ConvertReport`. See docs/interop.md; the command line is
``lightning-distckpt convert``.
"""

from ..convert import ConvertReport
from ..convert import relayout_checkpoint as relayout
from .dcp_out import to_dcp
from .megatron_out import to_megatron
from .safetensors_out import parse_size, to_safetensors
from .torch_file import from_torch_file, to_torch_file

__all__ = ["ConvertReport", "from_torch_file", "parse_size", "relayout", "to_dcp", "to_megatron", "to_safetensors",
           "to_torch_file"]

# The names this package had in release 0.2: resolved with a DeprecationWarning naming the new one.
_RENAMED = {"export_dcp": "to_dcp", "export_megatron": "to_megatron", "export_safetensors": "to_safetensors"}


def __getattr__(name: str):
    if name in _RENAMED:
        from ..deprecated import warn_moved

        warn_moved(f"{__name__}.{name}", __name__, _RENAMED[name])
        return globals()[_RENAMED[name]]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
