"""Checkpoint sources for files that are not our own directories: a ``torch.save`` file, a
``.safetensors`` file, a Hugging Face model directory. Each is one class implementing
:class:`~lightning_distckpt.reading.checkpoint.CheckpointSource` over
:class:`~lightning_distckpt.reading.formats.tensor_files.TensorFileSource`; :func:`detect` picks one."""

from .detect import KeyMap, detect

__all__ = ["KeyMap", "detect"]
