"""Plain records exchanged between ranks and stored in ``metadata.json``.

These are what planning works on: no tensors, no files, JSON-able, cheap to all-gather.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch

from ..core.errors import FormatError, ShardingError
from ..core.mapping import ShardedObject, ShardedTensor

FlatRange = Optional[Tuple[int, int]]

_DTYPES: Dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "float64": torch.float64,
    "int8": torch.int8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}


def dtype_name(dtype: torch.dtype, key: str = "?") -> str:
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise ShardingError(f"{key!r}: dtype {dtype} is not supported; supported: {sorted(_DTYPES)}") from None


def dtype_from_name(name: str, key: str = "?") -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise FormatError(f"{key!r}: unknown dtype {name!r} in checkpoint metadata") from None


def element_size(name: str) -> int:
    return _DTYPES[name].itemsize  # no tensor allocation: planning calls this per shard record


@dataclass(frozen=True)
class ShardRecord:
    """One rank's ShardedTensor, as seen by planning."""

    key: str
    dtype: str
    global_shape: Tuple[int, ...]
    offset: Tuple[int, ...]
    shape: Tuple[int, ...]  # shard shape in global axes (prepended axes included, size 1)
    flat: FlatRange
    main: bool
    rank: int

    @classmethod
    def of(cls, st: ShardedTensor, rank: int) -> "ShardRecord":
        fr = st.flattened_range
        return cls(
            key=st.key,
            dtype=dtype_name(st.dtype, st.key),
            global_shape=st.global_shape,
            offset=st.global_offset,
            shape=st.shard_shape,
            flat=(fr.start, fr.stop) if fr is not None else None,
            main=st.is_main_replica,
            rank=rank,
        )

    @property
    def shard_id(self) -> Tuple[Tuple[int, ...], Tuple[int, ...], FlatRange]:
        """Replicas of the same data share this id."""
        return (self.offset, self.shape, self.flat)

    @property
    def numel(self) -> int:
        return (self.flat[1] - self.flat[0]) if self.flat else math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * element_size(self.dtype)


@dataclass(frozen=True)
class ObjectRecord:
    """One rank's ShardedObject, as seen by planning."""

    key: str
    global_shape: Tuple[int, ...]
    offset: Tuple[int, ...]
    main: bool
    rank: int

    @classmethod
    def of(cls, so: ShardedObject, rank: int) -> "ObjectRecord":
        return cls(so.key, so.global_shape, so.global_offset, so.is_main_replica, rank)


@dataclass
class StoredShard:
    """A shard as written: where it sits in the global tensor and which rank's store holds it.

    ``packed``: None when the shard is its own array; else the element offset of its data (row-major)
    in the writer's pack array for the tensor's dtype, which holds the small shards of that writer.
    """

    offset: Tuple[int, ...]
    shape: Tuple[int, ...]
    flat: FlatRange
    writer: int
    index: int
    packed: Optional[int] = None

    @property
    def numel(self) -> int:
        return (self.flat[1] - self.flat[0]) if self.flat else math.prod(self.shape)


@dataclass
class TensorEntry:
    global_shape: Tuple[int, ...]
    dtype: str
    shards: List[StoredShard] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(s.numel for s in self.shards) * element_size(self.dtype)

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]


@dataclass
class StoredObject:
    offset: Tuple[int, ...]
    writer: int
    index: int


@dataclass
class ObjectEntry:
    global_shape: Tuple[int, ...]
    shards: List[StoredObject] = field(default_factory=list)


@dataclass
class CheckpointIndex:
    """What ``metadata.json`` says about the stored tensors and objects."""

    tensors: Dict[str, TensorEntry] = field(default_factory=dict)
    objects: Dict[str, ObjectEntry] = field(default_factory=dict)

    def to_json(self) -> Dict[str, Any]:
        return {
            "tensors": {
                k: {
                    "global_shape": list(e.global_shape),
                    "dtype": e.dtype,
                    "shards": [
                        {"offset": list(s.offset), "shape": list(s.shape), "flat": list(s.flat) if s.flat else None,
                         "writer": s.writer, "index": s.index, **({"packed": s.packed} if s.packed is not None else {})}
                        for s in e.shards
                    ],
                }
                for k, e in self.tensors.items()
            },
            "objects": {
                k: {
                    "global_shape": list(e.global_shape),
                    "shards": [{"offset": list(s.offset), "writer": s.writer, "index": s.index} for s in e.shards],
                }
                for k, e in self.objects.items()
            },
        }

    @classmethod
    def from_json(cls, data: Dict[str, Any], where: str) -> "CheckpointIndex":
        """Parse, checking types: metadata comes from disk and is not trusted."""

        def ints(v: Any, what: str) -> Tuple[int, ...]:
            if not isinstance(v, list) or not all(isinstance(i, int) and i >= 0 for i in v):
                raise FormatError(f"{where}: {what} must be a list of non-negative ints, got {v!r}")
            return tuple(v)

        def nonneg(v: Any, what: str) -> int:
            if not isinstance(v, int) or v < 0:
                raise FormatError(f"{where}: {what} must be a non-negative int, got {v!r}")
            return v

        try:
            index = cls()
            for key, e in data["tensors"].items():
                dtype_from_name(e["dtype"], key)
                entry = TensorEntry(ints(e["global_shape"], f"{key!r} global_shape"), e["dtype"])
                for s in e["shards"]:
                    flat = tuple(ints(s["flat"], f"{key!r} flat")) if s["flat"] is not None else None
                    packed = s.get("packed")
                    entry.shards.append(
                        StoredShard(ints(s["offset"], f"{key!r} offset"), ints(s["shape"], f"{key!r} shape"), flat,
                                    nonneg(s["writer"], f"{key!r} writer"), nonneg(s["index"], f"{key!r} index"),
                                    None if packed is None else nonneg(packed, f"{key!r} packed"))
                    )
                    if packed is not None and flat is not None:
                        raise FormatError(f"{where}: {key!r} shard {s['index']} is both flattened and packed")
                index.tensors[key] = entry
            for key, e in data["objects"].items():
                entry_o = ObjectEntry(ints(e["global_shape"], f"{key!r} global_shape"))
                for s in e["shards"]:
                    entry_o.shards.append(
                        StoredObject(ints(s["offset"], f"{key!r} offset"), nonneg(s["writer"], f"{key!r} writer"),
                                     nonneg(s["index"], f"{key!r} index"))
                    )
                index.objects[key] = entry_o
        except (KeyError, TypeError, AttributeError) as e:
            raise FormatError(f"{where}: malformed metadata.json ({type(e).__name__}: {e})") from None
        return index
