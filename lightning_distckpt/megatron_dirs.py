"""Megatron-Core's ``check_is_distributed_checkpoint`` and ``remove_sharded_tensors`` on our format
(single process, no group needed; docs/interop.md)."""

from __future__ import annotations

import os
from typing import Any

from .core.arguments import require
from .core.errors import ArgumentError, FormatError
from .reading.formats.megatron import megatron_config
from .storage.layout import is_our_committed_checkpoint
from .storage.paths import local_location, path_text


def check_is_distributed_checkpoint(checkpoint_dir: Any) -> bool:
    """Whether ``checkpoint_dir`` is a distributed checkpoint :func:`~lightning_distckpt.load` reads as
    one, as Megatron-Core's function of this name answers it: our committed checkpoint (its commit marker,
    and its ``metadata.json`` naming our format), or Megatron-Core's own (its ``metadata.json`` config).
    False for anything else: nothing there, a file, an uncommitted save, a damaged ``metadata.json``
    (Megatron-Core raises on an unparsable one). A local path (str or ``os.PathLike``); a URL is an
    ArgumentError. Nothing is read but the two small files."""
    path = local_location(path_text(checkpoint_dir, "checkpoint_dir"), "checkpoint_dir")
    if not os.path.isdir(path):
        return False
    if is_our_committed_checkpoint(path):
        return True
    try:
        return megatron_config(path) is not None
    except (OSError, FormatError):
        return False


def remove_sharded_tensors(checkpoint_dir: Any, key_prefix: str) -> None:
    """Megatron-Core's name, refused: it deletes tensors from a checkpoint in place, and ours is committed
    and checksummed as a whole (``metadata.json``'s index and SHA-256, the commit marker over it, shards
    packed together in each rank's store). Editing it in place cannot be made crash-safe: a process killed
    between rewriting the index and the data leaves a checkpoint that is committed but wrong. Always an
    ArgumentError naming the checkpoint and the prefix, before anything is read or touched; what to do
    instead: load what you keep (``ldc.load`` with a template of the other keys, or ``strict``'s
    ``RETURN_UNEXPECTED``) and save it as a new checkpoint, which is atomic."""
    require(key_prefix, str, "key_prefix", "a str")
    where = path_text(checkpoint_dir, "checkpoint_dir")
    raise ArgumentError(
        f"remove_sharded_tensors({where!r}, {key_prefix!r}): not supported: a lightning_distckpt checkpoint is "
        "committed and checksummed as a whole and never edited in place (an edit interrupted midway would leave a "
        "committed but wrong checkpoint); nothing was changed. Load the tensors you keep (lightning_distckpt.load "
        "with a template of the other keys) and save them as a new checkpoint (an atomic save)")
