"""A checkpoint source over files that hold whole (unsharded) tensors by name.

Each file key becomes one tensor entry with one stored shard covering the whole tensor (writer =
the file's number), so the reading pipeline plans resharded reads from such files exactly as from
our own checkpoints. A file format supplies an opener (:class:`TensorFile`): names, shape and
dtype of each tensor, and a slice read that touches only the bytes of the slice (safetensors
offsets, memory-mapped torch storages).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, NamedTuple, Optional, Protocol, Sequence, Tuple, Union

import torch

from ...core.errors import CheckpointingError, FormatError, ShardingError
from ...planning.metadata import CheckpointIndex, StoredShard, TensorEntry, dtype_name
from ...storage.base import ShardRead

KeyMap = Union[Dict[str, str], Callable[[str], Optional[str]], None]


class TensorFile(Protocol):
    """One file of tensors, opened (lazily: no tensor data read until asked)."""

    path: str

    def names(self) -> List[str]: ...

    def shape_dtype(self, name: str) -> Tuple[Tuple[int, ...], torch.dtype]: ...

    def read(self, name: str, src: Tuple[slice, ...]) -> torch.Tensor:
        """``tensor[src]`` as a CPU tensor, reading only what the slice needs where the format allows."""
        ...


class IndexedFile(NamedTuple):
    """A tensor file and the names an index assigns to it (None: every tensor in it)."""

    file: TensorFile
    keys: Optional[List[str]]


@dataclass(frozen=True)
class _Location:
    file: int
    name: str  # the key in the file (before key_map)


# Sizes, strides and byte counts are int64 in torch and numpy (the writers of convert): a shape whose
# extent in bytes reaches this cannot be allocated nor written, even with a 0 among its dims (the
# stride of a dim is the product of the dims after it, zeros or not; numpy multiplies the non-zero
# dims by the item size).
MAX_EXTENT = 1 << 63


def check_shape(where: str, shape: Sequence[int], itemsize: int) -> None:
    """Refuse a stored shape that cannot be allocated: the product of its dims, each counted as at
    least 1, times ``itemsize`` reaches 2**63 (``[0, 2**63]``: no bytes stored, no element claimed,
    yet ``torch.empty`` raises a raw TypeError or "Stride calculation overflowed" and numpy "array
    is too big"). No real tensor comes near it. ``where`` names the file and the tensor."""
    extent = itemsize
    for n in shape:
        extent *= max(n, 1)
        if extent >= MAX_EXTENT:  # stop early: a corrupt header may hold many huge dims
            raise FormatError(f"{where}: shape {list(shape)!r:.200} is too large (the product of its dims, 0 "
                              f"counted as 1, times {itemsize} bytes per element reaches 2**63); the file is corrupt")


def map_key(key_map: KeyMap, name: str) -> Optional[str]:
    """The template key of file key ``name`` (None: not offered to the template)."""
    if key_map is None:
        return name
    if callable(key_map):
        return key_map(name)
    return key_map.get(name, name)


def check_key(where: str, name: str, key: Any, what: str = "tensor") -> None:
    """Refuse a key no template can have: a file's own name, or what a key_map made of it, must be a non-empty
    str (a ShardedTensor's key), so the error names the file and how to load it anyway."""
    if not isinstance(key, str) or not key:
        raise FormatError(f"{where}: {what} {name!r} would be loaded under key {key!r}, not a non-empty string"
                          + ("" if key != name else f"; name it, or leave it out, with ldc.load's key_map "
                             f"({{{name!r}: 'a_name'}} or {{{name!r}: None}})"))


class TensorFileSource:
    """A :class:`~lightning_distckpt.reading.checkpoint.CheckpointSource` over tensor files."""

    def __init__(self, path: str, files: Sequence[IndexedFile], key_map: KeyMap = None, common: Any = None) -> None:
        self.path = path
        self._files = [f.file for f in files]
        self._common = {} if common is None else common
        self._where: Dict[str, _Location] = {}
        self.index = CheckpointIndex()
        for i, (f, listed) in enumerate(files):
            present = f.names()
            if listed is not None:
                absent = sorted(set(listed) - set(present))
                if absent:
                    raise FormatError(f"{f.path}: tensor {absent[0]!r}, listed in the index of {path}, "
                                      "is not in the file")
            for name in present if listed is None else listed:
                key = map_key(key_map, name)
                if key is not None:
                    self._add(i, name, key)

    def _add(self, file: int, name: str, key: str) -> None:
        f = self._files[file]
        check_key(f.path, name, key)
        if key in self._where:
            prev = self._where[key]
            raise FormatError(f"{self.path}: key {key!r} comes from both {self._files[prev.file].path} "
                              f"({prev.name!r}) and {f.path} ({name!r}); fix key_map")
        shape, dtype = f.shape_dtype(name)
        try:
            stored_dtype = dtype_name(dtype, name)
        except ShardingError:
            raise FormatError(f"{f.path}: tensor {name!r} has dtype {dtype}, which lightning_distckpt "
                              "cannot load") from None
        self._where[key] = _Location(file, name)
        self.index.tensors[key] = TensorEntry(shape, stored_dtype,
                                              [StoredShard((0,) * len(shape), shape, None, file, 0)])

    def reader(self) -> "TensorFileSource":
        return self

    @property
    def files(self) -> List["TensorFile"]:
        """The files read, in the index's order."""
        return list(self._files)

    def file_of(self, key: str) -> str:
        """The file holding the tensor loaded as ``key``."""
        return self._files[self._where[key].file].path

    def load_common(self, extra_safe_globals: Sequence[Any] = ()) -> Any:
        return self._common

    def read_into(self, reads: Iterable[ShardRead]) -> int:
        nbytes = 0
        for r in reads:
            loc = self._where[r.key]
            f = self._files[loc.file]
            try:
                piece = f.read(loc.name, r.src)
            except CheckpointingError:
                raise
            except Exception as e:  # a truncated or damaged file
                raise FormatError(f"{f.path}: reading tensor {loc.name!r} failed: {type(e).__name__}: {e}") from e
            r.dest.copy_(piece.reshape(r.dest.shape))
            nbytes += r.dest.numel() * r.dest.element_size()
        return nbytes

    def read_object(self, writer: int, key: str, index: int) -> bytes:
        raise FormatError(f"{self.path}: tensor files hold no sharded objects (asked for {key!r})")
