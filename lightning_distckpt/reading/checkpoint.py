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
from dataclasses import dataclass, field, replace
from typing import Any, Dict, Optional, Protocol, Sequence, runtime_checkable

from ..planning.metadata import CheckpointIndex
from ..storage.base import ShardReader
from ..storage.integrity import read_common, read_common_bytes
from ..storage.layout import DATA_DIR
from ..storage.store import CheckpointStore, StorageFacts, WriterStore, asked
from ..storage.stores import SaveTarget, open_store, store_of
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
    """A committed lightning_distckpt checkpoint, its metadata parsed and checked, in its store."""

    path: str  # where the committed checkpoint is read from (a real path, a committed version)
    meta: Dict[str, Any]
    index: CheckpointIndex
    options: StorageOptions  # the recorded layout with the reader's own choices (verify, concurrency, ...)
    marker: Dict[str, Any] = field(default_factory=dict)  # the commit marker (checksums of common.pt, metadata)
    store: Optional[CheckpointStore] = None
    _readers: Dict[bool, TensorStoreIO] = field(default_factory=dict, init=False, repr=False, compare=False)

    @classmethod
    def open(cls, checkpoint_dir: SaveTarget, options: Optional[StorageOptions] = None) -> "OpenedCheckpoint":
        """Open the committed checkpoint at ``checkpoint_dir`` through its store; ``options``: the
        reader's choices (``verify``, ``direct_reads``, ``io_concurrency``, the S3 endpoint, ...),
        the layout is the one recorded."""
        # the store refuses what it does not serve, and links inside the checkpoint, and checks every field
        store = store_of(checkpoint_dir, options)
        opened = asked(store, "open_metadata()", store.open_metadata)
        path, meta = opened.path, opened.meta
        recorded = StorageOptions.from_json(meta.get("storage", {}))
        stores = _rank_stores(path) if store.file_system else None  # bounds the index's even splits
        return cls(path, meta, CheckpointIndex.from_json(meta, f"checkpoint {path}", stores),
                   replace(store.options, layout=recorded.layout, chunk_bytes=recorded.chunk_bytes),
                   opened.marker, store)

    def _store(self) -> CheckpointStore:
        if self.store is None:  # made by hand, not by open(): the store serving its path
            self.store = open_store(self.path, self.options)
        return self.store

    def reader(self, check_sizes: bool = True) -> TensorStoreIO:
        """A new reader of this checkpoint's stored shards (packed ones included) and objects. The
        readers of one opened checkpoint share what the first derived from the index (a pass over
        every key: :meth:`TensorStoreIO.sibling`); each has its own stores and arrays."""
        first = self._readers.get(check_sizes)
        if first is None:
            first = self._readers[check_sizes] = self._open_reader(check_sizes)
            return first
        sibling = getattr(first, "sibling", None)  # a store's own reader type may not share
        return sibling() if sibling is not None else self._open_reader(check_sizes)

    def _open_reader(self, check_sizes: bool) -> TensorStoreIO:
        store = self._store()
        return asked(store, f"open_reader({self.path!r})", store.open_reader, self.path, self.options, self.index,
                     check_sizes)

    def read_blob(self, name: str) -> Optional[bytes]:
        """A whole blob of the checkpoint (``common.pt``), as stored; None when missing."""
        store = self._store()
        return asked(store, f"read_blob({self.path!r}, {name!r})", store.read_blob, self.path, name)

    def writer_store(self, writer: int) -> WriterStore:
        """Whether ``writer``'s store holds anything, and its bytes where listed (``validate``)."""
        store = self._store()
        return asked(store, f"writer_store({self.path!r}, {writer})", store.writer_store, self.path, writer)

    def storage_facts(self) -> StorageFacts:
        """What ``inspect`` shows of this checkpoint's storage (files, bytes, leftovers), as its store knows it."""
        store = self._store()
        return asked(store, f"facts({self.path!r})", store.facts, self.path)

    def common_bytes(self) -> bytes:
        """``common.pt`` as stored, checked against the SHA-256 its commit marker records."""
        return read_common_bytes(self._store(), self.path, self.marker)

    def load_common(self, extra_safe_globals: Sequence[Any] = ()) -> Any:
        return read_common(self._store(), self.path, self.marker, extra_safe_globals)


class SourceView:
    """A checkpoint source seen through a view that changes one aspect of a load (its subclasses);
    every attribute it does not set is the wrapped source's."""

    def __init__(self, source: CheckpointSource) -> None:
        self.source = source
        self.path: str = source.path
        self.index = source.index

    def reader(self) -> ShardReader:
        return self.source.reader()

    def load_common(self, extra_safe_globals: Sequence[Any] = ()) -> Any:
        return self.source.load_common(extra_safe_globals)

    def __getattr__(self, name: str) -> Any:
        if name == "source":  # not set yet (copy / unpickle): no recursion
            raise AttributeError(name)
        return getattr(self.source, name)


class TemplateOnly(SourceView):
    """``source`` read for the template's leaves only (``load(..., common=False)``): the load
    neither merges the common state nor reads the plain tensors stored where the template has no
    leaf (:attr:`keeps_common` False, asked by the pipeline through any wrapper). The common state
    is still read where the template's own plain tensors are kept there (a checkpoint that keeps
    them in it): their values come from nowhere else. Every other attribute is the source's."""

    keeps_common = False


def keeps_common(source: Any) -> bool:
    """Whether a load from ``source`` merges its common state (see :class:`TemplateOnly`)."""
    return bool(getattr(source, "keeps_common", True))


def content_id(source: Any) -> Optional[str]:
    """What identifies the checkpoint ``source`` holds, whatever path it was opened by: the SHA-256s
    of its ``metadata.json`` and ``common.pt`` that its commit marker records (the same for every
    copy of one checkpoint, a node-local one included). The exchange loaders send one rank's bytes
    to the others, so ranks that opened different checkpoints (a ``last`` link moved by a save
    between their opens) must be told apart before anything is read. None where unknown: another
    format, or a checkpoint older than format 3 (its marker records no checksums)."""
    marker = getattr(source, "marker", None)  # through any SourceView / shared opener
    if not isinstance(marker, dict) or "metadata_sha256" not in marker:
        return None
    return f"{marker['metadata_sha256']}/{marker.get('common_sha256')}"


def _rank_stores(path: str) -> Optional[int]:
    """How many entries the local checkpoint's ``data/`` holds (one listdir; None: none listed)."""
    try:
        return len(os.listdir(os.path.join(path, DATA_DIR)))
    except (OSError, ValueError):
        return None


def open_checkpoint(path: SaveTarget, key_map: KeyMap = None, extra_safe_globals: Sequence[Any] = (),
                    options: Optional[StorageOptions] = None) -> CheckpointSource:
    """The source for ``path``: a ``torch.save`` file, a ``.safetensors`` file or a Hugging Face
    model directory (``key_map`` maps their keys to template keys: a dict, or a callable returning
    None to leave a key out), else our own checkpoint in its store (``options``: the reader's
    choices, see :meth:`OpenedCheckpoint.open`)."""
    store = store_of(path, options)
    found = (detect(os.fspath(path), key_map, extra_safe_globals)
             if store.file_system and not isinstance(path, CheckpointStore) else None)
    return found if found is not None else OpenedCheckpoint.open(path, options)
