"""``validate``: read back every byte a checkpoint stores and report what is missing or damaged.

:func:`validate` checks our own checkpoints (:mod:`.checks`: metadata, index, every chunk's CRC-32C,
objects, the common state) and PyTorch DCP / Megatron-Core ``torch_dist`` directories
(:mod:`.foreign`: index and every record read, checked by its zip record's CRC-32). It returns a
:class:`ValidationReport`; ``lightning-distckpt validate`` prints one.
"""

from __future__ import annotations

import os
from typing import Callable, Optional, Union

from ..core.arguments import require, require_bool
from ..core.errors import ArgumentError
from ..progress import Progress
from ..storage.paths import checkpoint_location
from .checks import validate_checkpoint
from .foreign import open_foreign, validate_foreign
from .report import ValidationReport

DEFAULT_INFLIGHT_BYTES = 256 << 20


def validate(path: Union[str, "os.PathLike[str]"], *, require_checksums: bool = False,
             max_inflight_bytes: int = DEFAULT_INFLIGHT_BYTES, on_key: Optional[Callable[[str], None]] = None,
             progress: Optional[Progress] = None) -> ValidationReport:
    """Read back everything the checkpoint at ``path`` stores and report what is missing or damaged.

    Single process, no process group; nothing is written. Our checkpoints (local or ``s3://``):
    ``metadata.json`` against its commit marker, the index (every tensor tiled exactly once), every
    stored shard's array metadata, every chunk read and its CRC-32C checked, every object and the
    common state checked and unpickled with the same allow-list as :func:`load`. A PyTorch DCP or
    Megatron-Core ``torch_dist`` directory: its index and every record read (those formats store no
    checksums: a warning).

    Args:
        path: the checkpoint directory or ``s3://`` URL.
        require_checksums: a checkpoint written before checksums (format 1 or 2) is a problem, not a warning.
        max_inflight_bytes: bound on the bytes read concurrently.
        on_key: called with each key once its shards are checked.
        progress: counts the bytes read (:mod:`lightning_distckpt.progress`, e.g. a ``tqdm`` bar).

    Returns:
        A :class:`ValidationReport`: ``ok`` is False when anything is damaged; ``problems`` and
        ``warnings`` say what and where.

    Raises:
        IncompleteCheckpointError: nothing committed at ``path`` (CheckpointNotFoundError: nothing there).
        FormatError: not a checkpoint this library reads, or its metadata is malformed or tampered.
        ArgumentTypeError / ArgumentError: an argument of the wrong type or value.
    """
    location = checkpoint_location(path)
    require_bool(require_checksums, "require_checksums")
    require(max_inflight_bytes, int, "max_inflight_bytes", "an int")
    if isinstance(max_inflight_bytes, bool) or max_inflight_bytes <= 0:
        raise ArgumentError(f"max_inflight_bytes must be a positive number of bytes, not {max_inflight_bytes!r}")
    foreign = open_foreign(location)
    if foreign is not None:
        return validate_foreign(foreign, on_key, progress)
    return validate_checkpoint(location, max_inflight_bytes, on_key, require_checksums, progress)


__all__ = ["ValidationReport", "validate"]
