"""Plain records exchanged between ranks and stored in ``metadata.json``.

These are what planning works on: no tensors, no files, JSON-able, cheap to all-gather.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch

from ..core.format_versions import ALIASES_SINCE, CHECKSUMS_SINCE, EVEN_SINCE, SAVE_TOKEN_SINCE
from ..core.errors import FormatError
from ..core.gc_pause import gc_paused
from ..core.mapping import ShardedObject, ShardedTensor
from ..core.shown import quoted
from ..storage.save_token import recorded_token
from .aliases import aliases_to_json, parse_aliases
from .dtypes import _DTYPES, dtype_from_name, dtype_name, element_size  # noqa: F401 - re-exported
from .even_index import EvenSplit, chunks_count, parse_even, replay_packs
from .index_fast import fast_tensor_entries, refuse_colliding_keys

FlatRange = Optional[Tuple[int, int]]


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
    # the key whose shard here is this one's very memory (planning/aliases.py), where one is
    tie: Optional[str] = None

    @classmethod
    def of(cls, st: ShardedTensor, rank: int) -> "ShardRecord":
        """The record of ``st`` (checked by its own construction): its fields set in one step, not one
        ``object.__setattr__`` each as a frozen dataclass's ``__init__`` does (half the time; one
        record per tensor per save)."""
        fr = st.flattened_range
        record = object.__new__(cls)
        record.__dict__.update(
            key=st.key,
            dtype=dtype_name(st.dtype, st.key),
            global_shape=st.global_shape,
            offset=st.global_offset,
            shape=st.shard_shape,
            flat=(fr.start, fr.stop) if fr is not None else None,
            main=st.is_main_replica,
            rank=rank,
            tie=None,
        )
        return record

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


@dataclass(slots=True)  # a loader may list millions (an FSDP-like index): slots make them cheap
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


class TensorEntry:
    """A stored tensor: global shape, dtype and stored shards. ``even``: the shards are the
    chunks of an even dim-0 split (``planning/even_index.py``), listed on first use of ``shards``
    and written to ``metadata.json`` as the rule, not the list."""

    def __init__(self, global_shape: Tuple[int, ...], dtype: str, shards: Optional[List[StoredShard]] = None,
                 even: Optional[EvenSplit] = None) -> None:
        self.global_shape = global_shape
        self.dtype = dtype
        self.even = even
        self._shards = shards if shards is not None or even is not None else []

    @property
    def shards(self) -> List[StoredShard]:
        if self._shards is None:
            with gc_paused():  # thousands of shards at once (see gc_paused)
                self._shards = self.shards_in_rows(0, self.global_shape[0])
        return self._shards

    @shards.setter
    def shards(self, shards: List[StoredShard]) -> None:
        self._shards, self.even = shards, None

    def shards_in_rows(self, start: int, stop: int) -> List[StoredShard]:
        """The stored shards that may hold rows [start, stop) of dim 0 (all but an even split's
        other chunks)."""
        if self.even is None or self._shards is not None and start <= 0 and stop >= self.global_shape[0]:
            return self.shards
        lo, hi = self.even.rows_range(self.global_shape, start, stop)
        return [StoredShard(offset, shape, None, i, i, packed)
                for i, offset, shape, packed in self.even.chunks(self.global_shape, lo, hi)]

    @property
    def nbytes(self) -> int:
        if self.even is not None:
            return math.prod(self.global_shape) * element_size(self.dtype)
        return sum(s.numel for s in self.shards) * element_size(self.dtype)

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TensorEntry):
            return NotImplemented
        if self.even is not None and other.even is not None:
            same = self.even.same_as(other.even)
        else:
            same = self.shards == other.shards
        return same and (tuple(self.global_shape), self.dtype) == (tuple(other.global_shape), other.dtype)

    def __repr__(self) -> str:
        what = f"even={self.even.to_json()}" if self.even is not None else f"shards={self.shards!r}"
        return f"TensorEntry(global_shape={self.global_shape!r}, dtype={self.dtype!r}, {what})"

    def to_json(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {"global_shape": list(self.global_shape), "dtype": self.dtype}
        if self.even is not None:
            out["even"] = self.even.to_json()
            return out
        out["shards"] = [
            {"offset": list(s.offset), "shape": list(s.shape), "flat": list(s.flat) if s.flat else None,
             "writer": s.writer, "index": s.index, **({"packed": s.packed} if s.packed is not None else {})}
            for s in self.shards
        ]
        return out


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
    # Stored data carries checksums (format 3 on): readers then require them on objects.
    checksums: bool = field(default=True, compare=False)
    # The save that wrote the stores (format 7, storage/save_token.py): every array and object must say the same.
    save_token: Optional[str] = field(default=None, compare=False)
    # alias -> target (format 8, planning/aliases.py): ``tensors[alias]`` is the target's entry, stored once
    aliases: Dict[str, str] = field(default_factory=dict)

    def stored_tensors(self) -> Dict[str, TensorEntry]:
        """The tensors with stored shards of their own (every key but the aliases)."""
        if not self.aliases:
            return self.tensors
        return {k: e for k, e in self.tensors.items() if k not in self.aliases}

    def stored_key(self, key: str) -> str:
        """The key whose stored shards hold ``key``'s data."""
        return self.aliases.get(key, key) if self.aliases else key

    def bytes_per_writer(self) -> Dict[int, int]:
        """writer rank -> bytes of the tensor data this index says its store holds."""
        out: Dict[int, int] = {}
        # even splits' bytes per rank (chunk i on rank i, whatever the split's size): sized by the
        # chunks, which the parse bounded by the rank stores, not by the ranks a split claims
        stored = self.stored_tensors()  # an alias's bytes are its target's
        evens = [e for e in stored.values() if e.even is not None]
        acc = np.zeros(max((chunks_count(e.global_shape, e.even.over) for e in evens), default=0), dtype=np.int64)
        few = [0] * min(len(acc), 64)  # splits over few ranks summed in plain ints (numpy per key cost ~3 µs)
        for e in stored.values():
            size = element_size(e.dtype)
            if e.even is not None:
                e.even.add_bytes(e.global_shape, size, few, acc)
                continue
            for s in e.shards:
                out[s.writer] = out.get(s.writer, 0) + s.numel * size
        acc[:len(few)] += np.array(few, dtype=np.int64)
        for w in np.flatnonzero(acc).tolist():
            out[w] = out.get(w, 0) + int(acc[w])
        return out

    def to_json(self) -> Dict[str, Any]:
        return {
            "tensors": {k: e.to_json() for k, e in self.stored_tensors().items()},
            **({"aliases": aliases_to_json(self.aliases, self.tensors)} if self.aliases else {}),
            "objects": {
                k: {
                    "global_shape": list(e.global_shape),
                    "shards": [{"offset": list(s.offset), "writer": s.writer, "index": s.index} for s in e.shards],
                }
                for k, e in self.objects.items()
            },
        }

    @classmethod
    def from_json(cls, data: Dict[str, Any], where: str, rank_stores: Optional[int] = None) -> "CheckpointIndex":
        """Parse ``metadata.json``'s index, checking every field's type and range (FormatError
        naming the field): it comes from disk and is not trusted. Shapes are bounded and each
        shard lies inside its tensor, so nothing sized by the index can ask for absurd memory.
        ``rank_stores``: how many rank stores the checkpoint's ``data/`` holds, where the reader
        counted them; an even split claiming chunks on more ranks is refused before it is sized."""
        with gc_paused():  # tens of thousands of small records (see gc_paused): 3.5x faster without collections
            return cls._from_json(data, where, rank_stores)

    @classmethod
    def _from_json(cls, data: Dict[str, Any], where: str, rank_stores: Optional[int]) -> "CheckpointIndex":
        f = _Fields(where)
        # Absent only in an index built by hand (the readers refuse a metadata.json without it): read
        # with checksums and even splits, as every version since 4.
        version = data.get("format_version", EVEN_SINCE)
        index = cls(checksums=isinstance(version, int) and version >= CHECKSUMS_SINCE)
        if isinstance(version, int) and version >= SAVE_TOKEN_SINCE:
            index.save_token = recorded_token(data, where)
        tensors = f.obj(data.get("tensors"), "tensors")
        even_ok = isinstance(version, int) and version >= EVEN_SINCE
        # the common entries checked and built without naming their fields; the rest (and any fault) below
        fast = fast_tensor_entries(tensors, even_ok, data.get("world_size"), rank_stores, MAX_TENSOR_BYTES)
        if len(fast) == len(tensors):  # every entry built (and checked) there, in the index's order: no loop per key
            index.tensors.update(fast)
            tensors = {}
        for key, e in tensors.items():
            if type(key) is str and key in fast:
                index.tensors[key] = fast[key]
                continue
            name = f"tensors[{quoted(key)}]"  # a key of megabytes names its field cut short
            e = f.obj(e, name)
            dtype = e.get("dtype")
            if not isinstance(dtype, str) or dtype not in _DTYPES:
                raise f.fail(f"{name}.dtype", f"a dtype this release knows, one of {sorted(_DTYPES)} (an unknown "
                             "dtype: written by a newer release of lightning_distckpt? upgrade it)", dtype)
            gshape = f.shape(e.get("global_shape"), f"{name}.global_shape")
            if math.prod(gshape) * element_size(dtype) > MAX_TENSOR_BYTES:
                raise FormatError(f"{where}: metadata.json field {name}.global_shape {list(gshape)} claims more than "
                                  f"{MAX_TENSOR_BYTES} bytes")
            if "even" in e and even_ok:
                if "shards" in e:
                    raise FormatError(f"{where}: metadata.json field {name} has both shards and even (one of them)")
                even = parse_even(e["even"], gshape, name, where, data.get("world_size"), rank_stores)
                entry = TensorEntry(gshape, dtype, even=even)
            else:
                entry = TensorEntry(gshape, dtype)
                for i, s in enumerate(f.list(e.get("shards"), f"{name}.shards")):
                    entry.shards.append(f.stored_shard(s, gshape, f"{name}.shards[{i}]"))
            index.tensors[f.key(key, "tensors")] = entry
        replay_packs(index.tensors, where)
        for key, e in f.obj(data.get("objects"), "objects").items():
            name = f"objects[{quoted(key)}]"
            e = f.obj(e, name)
            gshape = f.shape(e.get("global_shape"), f"{name}.global_shape")
            entry_o, stored = ObjectEntry(gshape), set()
            for i, s in enumerate(f.list(e.get("shards"), f"{name}.shards")):
                what = f"{name}.shards[{i}]"
                s = f.obj(s, what)
                offset = f.shape(s.get("offset"), f"{what}.offset", len(gshape))
                if any(o >= g for o, g in zip(offset, gshape)):
                    raise f.fail(f"{what}.offset", f"inside the global shape {list(gshape)}", list(offset))
                at = (f.count(s.get("writer"), f"{what}.writer"), f.count(s.get("index"), f"{what}.index"))
                if at in stored:  # two elements read from one stored blob: not written by us
                    raise FormatError(f"{where}: metadata.json field {what}: a second element of {key!r} stored as "
                                      f"element {at[1]} of rank {at[0]}")
                stored.add(at)
                entry_o.shards.append(StoredObject(offset, *at))
            index.objects[f.key(key, "objects")] = entry_o
        refuse_colliding_keys(index, where)
        if "aliases" in data:  # after the checks of the stored keys: an alias stores nothing
            if not (isinstance(version, int) and version >= ALIASES_SINCE):
                raise FormatError(f"{where}: metadata.json field aliases is not in format version {version!r} "
                                  f"(from {ALIASES_SINCE} on): not written by us")
            index.aliases = parse_aliases(data["aliases"], index.tensors, index.objects, where)
        return index


MAX_TENSOR_BYTES = 1 << 50  # 1 PiB: no tensor of a checkpoint is bigger; a bigger claim is damage
_MAX_NDIM = 32
_MAX_COUNT = 1 << 31  # writers, indices


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


class _Fields:
    """Checks of the values of metadata.json's fields; each failure is a FormatError naming the field."""

    def __init__(self, where: str) -> None:
        self.where = where

    def fail(self, field_name: str, must: str, value: Any) -> FormatError:
        return FormatError(f"{self.where}: metadata.json field {field_name} must be {must}, got {_short(value)}")

    def obj(self, v: Any, name: str) -> Dict[str, Any]:
        if not isinstance(v, dict):
            raise self.fail(name, "an object", v)
        return v

    def list(self, v: Any, name: str) -> List[Any]:
        if not isinstance(v, list):
            raise self.fail(name, "a list", v)
        return v

    def key(self, k: Any, name: str) -> str:
        if not isinstance(k, str) or not k:
            raise self.fail(f"{name} key", "a non-empty string", k)
        return k

    def count(self, v: Any, name: str, limit: int = _MAX_COUNT) -> int:
        if type(v) is not int or not 0 <= v < limit:
            raise self.fail(name, f"an int in [0, {limit})", v)
        return v

    def shape(self, v: Any, name: str, ndim: Optional[int] = None) -> Tuple[int, ...]:
        if not isinstance(v, list) or len(v) > _MAX_NDIM or not all(type(i) is int and 0 <= i < 1 << 62 for i in v):
            raise self.fail(name, f"a list of at most {_MAX_NDIM} non-negative ints", v)
        if ndim is not None and len(v) != ndim:
            raise self.fail(name, f"a list of {ndim} ints (the tensor's dimensions)", v)
        return tuple(v)

    def stored_shard(self, s: Any, gshape: Tuple[int, ...], name: str) -> StoredShard:
        s = self.obj(s, name)
        offset = self.shape(s.get("offset"), f"{name}.offset", len(gshape))
        shape = self.shape(s.get("shape"), f"{name}.shape", len(gshape))
        if any(o + n > g for o, n, g in zip(offset, shape, gshape)):
            raise FormatError(f"{self.where}: metadata.json field {name}: offset {list(offset)} + shape {list(shape)} "
                              f"lies outside the global shape {list(gshape)}")
        flat: FlatRange = None
        if s.get("flat") is not None:
            fr = s["flat"]
            if not (isinstance(fr, list) and len(fr) == 2 and all(type(i) is int for i in fr)
                    and 0 <= fr[0] <= fr[1] <= math.prod(shape)):
                raise self.fail(f"{name}.flat", f"[start, stop] with 0 <= start <= stop <= {math.prod(shape)}", fr)
            flat = (fr[0], fr[1])
        packed = s.get("packed")
        if packed is not None:
            packed = self.count(packed, f"{name}.packed", 1 << 62)
            if flat is not None:
                raise FormatError(f"{self.where}: metadata.json field {name} is both flattened and packed")
        return StoredShard(offset, shape, flat, self.count(s.get("writer"), f"{name}.writer"),
                           self.count(s.get("index"), f"{name}.index"), packed)
