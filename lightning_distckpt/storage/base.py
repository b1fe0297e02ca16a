"""The storage interface: *where* stored shards and objects live, apart from *what* is saved.

Planning decides which rank writes which stored shard (``writer``, ``index``) and which piece of
it each reader needs; a store only moves bytes:

* :class:`ShardWriter` writes one rank's stored shards (:class:`ShardWrite`) and objects
  (:class:`ObjectWrite`) and names its backend for ``metadata.json``;
* :class:`ShardReader` copies requested pieces of stored shards (:class:`ShardRead`, each with
  its destination tensor) and reads objects back.

:class:`~lightning_distckpt.storage.tensorstore_io.TensorStoreIO` implements both for our own
checkpoints, over the key-value store of their :class:`~lightning_distckpt.storage.store.CheckpointStore`
(which owns the rest of a checkpoint's life: staging, blobs, commit, versions). A reader of another
format (a safetensors file, a DCP directory) implements :class:`ShardReader` over its own bytes and
plugs into the reading pipeline (:mod:`lightning_distckpt.reading`) without touching it.
"""

from __future__ import annotations

from typing import ClassVar, Iterable, NamedTuple, Optional, Protocol, Sequence, Tuple, runtime_checkable

import torch


class ShardWrite(NamedTuple):
    """One stored shard to write: ``data`` in global-axes shape (1-D for flattened shards).
    ``packed``: None for an array of its own, else the element offset in the writer's pack array
    of ``data``'s dtype (set by the save plan)."""

    key: str
    index: int
    data: torch.Tensor
    packed: Optional[int] = None


class ObjectWrite(NamedTuple):
    """One ShardedObject element to write: its serialized bytes under (key, index)."""

    key: str
    index: int
    blob: bytes


class ShardRead(NamedTuple):
    """Copy ``stored[src]`` of stored shard ``index`` of ``key`` (written by rank ``writer``) into
    ``dest``: a CPU tensor (often a view into the caller's tensor) of ``src``'s shape. The stored
    values are converted to ``dest``'s dtype."""

    key: str
    writer: int
    index: int
    src: Tuple[slice, ...]
    dest: torch.Tensor


@runtime_checkable
class ShardWriter(Protocol):
    """Writes stored shards and objects into one checkpoint's staging location."""

    backend: ClassVar[str]  # recorded in metadata.json's "storage" section

    def write(self, writer: int, tensors: Sequence[ShardWrite], objects: Sequence[ObjectWrite] = ()) -> int:
        """Write rank ``writer``'s shards and objects; durable when it returns. Returns bytes written.
        ``data`` must stay unchanged until this returns (it may be read in place)."""
        ...


@runtime_checkable
class ShardReader(Protocol):
    """Reads pieces of stored shards and objects of one checkpoint."""

    def read_into(self, reads: Iterable[ShardRead]) -> int:
        """Perform every read (concurrently where the store allows); returns bytes delivered.
        Raises CheckpointingError naming the key and writer of what could not be read."""
        ...

    def read_object(self, writer: int, key: str, index: int) -> bytes:
        """The bytes of ShardedObject element ``index`` of ``key``."""
        ...
