"""torch DCP's writers other than its default, for the tests of reading them: zstd-compressed items
(``_extensions=[ZStandard()]``) and ``serialization_format=SAFETENSORS``."""

import warnings

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._extension import ZStandard
from torch.distributed.checkpoint.filesystem import SerializationFormat


def variant_writer(path, kind):
    """DCP's ``FileSystemWriter`` at ``path`` for ``kind``: ``"zstd"`` or ``"safetensors"``."""
    if kind == "zstd":
        return dcp.FileSystemWriter(path, _extensions=[ZStandard()])
    return dcp.FileSystemWriter(path, serialization_format=SerializationFormat.SAFETENSORS)


def save_variant(state, path, kind):
    """``dcp.save`` of ``state`` in one process through :func:`variant_writer`; returns ``path``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no_dist's deprecation note
        dcp.save(state, storage_writer=variant_writer(path, kind), no_dist=True)
    return path
