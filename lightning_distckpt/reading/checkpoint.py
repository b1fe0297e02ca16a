"""Opening a checkpoint for reading: the source the reading pipeline reads from.

A :class:`CheckpointSource` is an index of what is stored (keys, global shapes, dtypes and the
stored shards of each tensor and object, :class:`~lightning_distckpt.planning.metadata.CheckpointIndex`),
a :class:`~lightning_distckpt.storage.base.ShardReader` for the stored bytes and the common state.
:class:`OpenedCheckpoint` is the source for our own directories; a reader of another format
(a safetensors file, a DCP directory) is another class with the same three members, returned by
:func:`open_checkpoint` for the paths it recognizes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Dict, Protocol, Sequence, runtime_checkable

from ..planning.metadata import CheckpointIndex
from ..storage.base import ShardReader
from ..storage.integrity import open_checkpoint_metadata, read_common
from ..storage.s3_url import is_s3_url
from ..storage.tensorstore_io import StorageOptions, TensorStoreIO
from .formats import KeyMap, detect


@runtime_checkable
class CheckpointSource(Protocol):
    """What the reading pipeline needs of a checkpoint, whatever its format or store."""

    path: str
    index: CheckpointIndex

    def reader(self) -> ShardReader:
        """A reader of the stored shards and objects (one per load: it may cache opened arrays)."""
        ...

    def load_common(self, extra_safe_globals: Sequence[Any] = ()) -> Any:
        """The common (non-sharded) state, deserialized safely."""
        ...


@dataclass
class OpenedCheckpoint:
    """A committed lightning_distckpt checkpoint directory, its metadata parsed and checked."""

    path: str
    meta: Dict[str, Any]
    index: CheckpointIndex
    options: StorageOptions
    marker: Dict[str, Any] = field(default_factory=dict)  # the commit marker (checksums of common.pt, metadata)

    @classmethod
    def open(cls, checkpoint_dir: str) -> "OpenedCheckpoint":
        # storage.integrity: refuses URLs but s3://, and links inside the checkpoint, checks every field
        opened = open_checkpoint_metadata(checkpoint_dir)
        path, meta = opened.path, opened.meta
        return cls(path, meta, CheckpointIndex.from_json(meta, f"checkpoint {path}"),
                   StorageOptions.from_json(meta.get("storage", {})), opened.marker)

    def reader(self) -> TensorStoreIO:
        """A reader of this checkpoint's stored shards (packed ones included) and objects."""
        return TensorStoreIO(self.path, self.options, self.index)

    def load_common(self, extra_safe_globals: Sequence[Any] = ()) -> Any:
        return read_common(self.path, self.marker, extra_safe_globals)


def open_checkpoint(path: str, key_map: KeyMap = None, extra_safe_globals: Sequence[Any] = ()) -> CheckpointSource:
    """The source for ``path``: a ``torch.save`` file, a ``.safetensors`` file or a Hugging Face
    model directory (``key_map`` maps their keys to template keys: a dict, or a callable returning
    None to leave a key out), else our own checkpoint directory (or ``s3://`` location)."""
    if is_s3_url(path):
        return OpenedCheckpoint.open(path)
    found = detect(os.fspath(path), key_map, extra_safe_globals)
    return found if found is not None else OpenedCheckpoint.open(path)
