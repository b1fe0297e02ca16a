"""Checkpoint sources for what is not our own directory: a ``torch.save`` file, a ``.safetensors``
file, a Hugging Face model directory (all three through
:class:`~lightning_distckpt.reading.formats.tensor_files.TensorFileSource`), and a PyTorch DCP
directory (:class:`~lightning_distckpt.reading.formats.dcp.DcpSource`). Each implements
:class:`~lightning_distckpt.reading.checkpoint.CheckpointSource`; :func:`detect` picks one."""

from .detect import KeyMap, detect

__all__ = ["KeyMap", "detect"]
