"""Even dim-0 splits in the checkpoint index: one entry per tensor, not one per stored shard.

An FSDP-like save (``planning/even.py``) stores each tensor as an even split of dim 0 over all
N ranks: chunk i (``ceil(G0 / N)`` rows at ``i x chunk``, the last chunks shorter) is stored
shard i, written by rank i. Listing those shards costs tensors x ranks entries in
``metadata.json`` (149 MB at 4,096 ranks, every loader parsing it); ``EvenSplit`` is the rule
instead: ``{"even": {"over": N, "packed_from": k}}`` (format 4 on).

Small chunks are packed (``StoredShard.packed``): the chunks from ``k`` on (all chunks but the
last have the same size, so the packed ones are a suffix). Where each lands in its writer's pack
array follows the rule every plan packs by: each writer's packed shards of one dtype lie back to
back in the order of the index's keys (sorted) and, within a key, of the stored shards.
``PackEnds`` replays it: the planner to place shards, a reader to find the even chunks' places
(checking that the listed shards' places follow it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Set, Tuple

import numpy as np

from ..core.errors import FormatError

MAX_OVER = 1 << 20  # ranks of an even split read from metadata.json (more is damage)
MAX_CHUNKS = 1 << 26  # chunks of all even splits of one index: bounds what a reader allocates


@dataclass(eq=False)
class EvenSplit:
    """A tensor stored as an even dim-0 split over ``over`` ranks: chunk i is stored shard i,
    written by rank i; ``packed``: the pack offsets of chunks ``packed_from`` on (set by the
    plan, or by :func:`replay_packs` when read)."""

    over: int
    packed_from: int
    packed: Optional[np.ndarray] = None

    @classmethod
    def of(cls, global_shape: Tuple[int, ...], over: int, itemsize: int, pack_max_bytes: int) -> "EvenSplit":
        """The split of ``global_shape`` over ``over`` ranks, packing chunks of at most
        ``pack_max_bytes`` (not empty) as the save plan packs shards."""
        n = chunks_count(global_shape, over)
        per_row = math.prod(global_shape[1:]) * itemsize
        if n == 0 or per_row == 0:
            return cls(over, n)
        rows = -(-global_shape[0] // over)
        last = global_shape[0] - (n - 1) * rows
        first = 0 if rows * per_row <= pack_max_bytes else (n - 1 if last * per_row <= pack_max_bytes else n)
        return cls(over, first)

    def rows(self, global_shape: Tuple[int, ...]) -> int:
        return -(-global_shape[0] // self.over)

    def numels(self, global_shape: Tuple[int, ...]) -> np.ndarray:
        """Elements of each (non-empty) chunk, chunk i at position i."""
        n, rows = chunks_count(global_shape, self.over), self.rows(global_shape)
        per_row = math.prod(global_shape[1:])
        out = np.full(n, rows * per_row, dtype=np.int64)
        if n:
            out[-1] = (global_shape[0] - (n - 1) * rows) * per_row
        return out

    def add_bytes(self, global_shape: Tuple[int, ...], itemsize: int, few: List[int], acc: np.ndarray) -> None:
        """Add chunk i's bytes to ``few[i]`` (plain ints, where the chunks are at most ``len(few)``:
        numpy per key cost ~3 µs) or else to ``acc[i]``."""
        n = chunks_count(global_shape, self.over)
        if n > len(few):
            acc[:n] += self.numels(global_shape) * itemsize
            return
        rows, per_row = self.rows(global_shape), math.prod(global_shape[1:]) * itemsize
        for i in range(n - 1):
            few[i] += rows * per_row
        if n:
            few[n - 1] += (global_shape[0] - (n - 1) * rows) * per_row

    def chunks(self, global_shape: Tuple[int, ...], lo: int = 0,
               hi: Optional[int] = None) -> List[Tuple[int, Tuple[int, ...], Tuple[int, ...], Optional[int]]]:
        """(i, offset, shape, packed) of the chunks i in [lo, hi)."""
        g0 = global_shape[0]
        rows = -(-g0 // self.over)
        n = -(-g0 // rows) if rows else 0  # chunks_count, inline: a loader asks once per key and writer
        lo, hi = max(lo, 0), n if hi is None or hi > n else hi
        if hi <= lo:
            return []
        rest = tuple(global_shape[1:])
        zeros = (0,) * len(rest)
        if hi - lo == 1:  # one chunk (a rank's own, the common question): no lists of lists
            at = self.packed[lo - self.packed_from] if self.packed is not None and lo >= self.packed_from else None
            length = rows if hi * rows <= g0 else g0 - lo * rows
            return [(lo, (lo * rows,) + zeros, (length,) + rest, None if at is None else int(at))]
        first = min(max(lo, self.packed_from), hi)  # the first packed chunk asked for
        packed: List[Optional[int]] = [None] * (first - lo)
        packed += self.packed[first - self.packed_from:hi - self.packed_from].tolist() \
            if self.packed is not None else [None] * (hi - first)
        shapes = [(rows,) + rest] * (hi - lo)
        if hi * rows > g0:  # the last chunk is shorter
            shapes[-1] = (g0 - (hi - 1) * rows,) + rest
        offsets = [(start,) + zeros for start in range(lo * rows, hi * rows, rows)]
        return list(zip(range(lo, hi), offsets, shapes, packed))

    def chunk_at(self, global_shape: Tuple[int, ...], offset: Tuple[int, ...], shape: Tuple[int, ...]) -> Optional[int]:
        """The chunk that is exactly the box ``offset``, ``shape`` (a rank's own shard, loaded as
        saved), or None: what :meth:`chunks` would list alone for its rows, without listing it."""
        g0 = global_shape[0]
        rows = -(-g0 // self.over)
        if rows == 0 or offset[0] < 0 or offset[0] % rows:
            return None
        i = offset[0] // rows
        length = rows if (i + 1) * rows <= g0 else g0 - i * rows
        if length <= 0 or shape[0] != length or any(offset[1:]) or tuple(shape[1:]) != tuple(global_shape[1:]):
            return None
        return i

    def rows_range(self, global_shape: Tuple[int, ...], start: int, stop: int) -> Tuple[int, int]:
        """The chunks holding rows [start, stop) of dim 0."""
        rows = self.rows(global_shape)
        if rows == 0 or stop <= start:
            return 0, 0
        return start // rows, -(-stop // rows)

    def to_json(self) -> Dict[str, int]:
        return {"over": self.over, "packed_from": self.packed_from}

    def same_as(self, other: "EvenSplit") -> bool:
        mine = self.packed.tolist() if self.packed is not None else None
        theirs = other.packed.tolist() if other.packed is not None else None
        return (self.over, self.packed_from, mine) == (other.over, other.packed_from, theirs)


def chunks_count(global_shape: Tuple[int, ...], over: int) -> int:
    """How many ranks hold a (non-empty) chunk of an even split: the first ones."""
    rows = -(-global_shape[0] // over)
    return -(-global_shape[0] // rows) if rows else 0


class PackEnds:
    """Elements packed so far per writer and dtype, in index order: one shard at a time
    (``take``), or one chunk per rank of an even split at once (``take_even``, vectorised)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._ends: Dict[str, np.ndarray] = {}  # dtype -> end per rank below size
        self._loose: Dict[str, Dict[int, int]] = {}  # dtype -> writer -> end, newer than _ends

    def take(self, writer: int, dtype: str, numel: int) -> int:
        """Where a packed shard of ``numel`` elements starts in ``writer``'s pack array of ``dtype``."""
        loose = self._loose.get(dtype)
        if loose is None:
            loose = self._loose[dtype] = {}
        at = loose.get(writer)
        if at is None:
            ends = self._ends.get(dtype)
            at = int(ends[writer]) if ends is not None and writer < self.size else 0
        loose[writer] = at + numel
        return at

    def take_even(self, dtype: str, numels: np.ndarray, first: int) -> np.ndarray:
        """Where chunks ``first`` on (chunk i of ``numels[i]`` elements, written by rank i) start."""
        ends = self._ends.get(dtype)
        if ends is None:
            ends = self._ends[dtype] = np.zeros(self.size, dtype=np.int64)
        loose = self._loose.get(dtype)
        if loose:
            self._loose[dtype] = {w: end for w, end in loose.items() if w >= self.size}
            inside = [(w, end) for w, end in loose.items() if w < self.size]
            if inside:
                ws, vs = zip(*inside)
                ends[list(ws)] = vs
        n = len(numels)
        if first == 0 and n == self.size:  # every rank's chunk packed (small tensors): one numpy step, not four
            self._ends[dtype] = ends + numels
            return ends  # no longer the running ends: the caller's to keep
        at = ends[first:n].copy()
        ends[first:n] += numels[first:n]
        return at


def chunks_bound(rank_stores: int) -> int:
    """The most chunks an even split may claim where ``data/`` holds ``rank_stores`` rank stores:
    twice as many plus 64, so what the claim sizes stays proportional to what is stored, while lost
    stores (damage the readers name) are not mistaken for a forged ``world_size``."""
    return 2 * rank_stores + 64


def parse_even(value: Any, global_shape: Tuple[int, ...], name: str, where: str,
               world_size: Optional[int] = None, rank_stores: Optional[int] = None) -> EvenSplit:
    """An entry's ``even`` field, checked (FormatError naming the field) before anything is sized by
    it: a split is over at most ``world_size`` ranks (metadata.json's ``world_size``: rank i wrote
    chunk i, so a split over more ranks than saved is damage; without it, :data:`MAX_OVER`), and,
    where the reader counted the checkpoint's rank stores (``rank_stores``), its chunks are at most
    that many: rank i's store holds chunk i, so a larger claim (``world_size`` forged with it) is
    refused here, before anything is sized by the chunks. The bound leaves room
    (:func:`chunks_bound`) so that a few lost rank stores are reported as the missing data they are
    (``validate``: exit status 1, naming the rank), not as forged metadata."""
    def fail(what: str, must: str, got: Any) -> FormatError:
        return FormatError(f"{where}: metadata.json field {name}.even{what} must be {must}, got {_short(got)}")

    if not isinstance(value, dict):
        raise fail("", "an object", value)
    if not global_shape:
        raise fail("", "absent on a scalar (an even split is of dim 0)", value)
    most = MAX_OVER if type(world_size) is not int or world_size < 1 else min(world_size, MAX_OVER)
    over = value.get("over")
    if type(over) is not int or not 1 <= over <= most:
        bound = f"the checkpoint's world_size {world_size}" if most == world_size else f"{MAX_OVER}"
        raise fail(".over", f"an int in [1, {most}] (at most {bound})" if most != MAX_OVER else
                   f"an int in [1, {MAX_OVER}]", over)
    n = chunks_count(global_shape, over)
    if rank_stores is not None and n > chunks_bound(rank_stores):
        raise FormatError(f"{where}: metadata.json field {name}.even.over {over} (field world_size: "
                          f"{_short(world_size)}) puts {n} chunks on as many writer ranks, but data/ holds "
                          f"{rank_stores} rank stores (rank i stores chunk i): damaged or forged metadata")
    first = value.get("packed_from")
    if type(first) is not int or not 0 <= first <= n:
        raise fail(".packed_from", f"an int in [0, {n}]", first)
    return EvenSplit(over, first)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def replay_packs(tensors: Mapping[str, Any], where: str) -> None:
    """Set the pack offsets of the even splits among ``tensors`` (key -> TensorEntry) by the
    packing rule; a listed packed shard not where the rule puts it is a FormatError."""
    chunks = [chunks_count(e.global_shape, e.even.over) for e in tensors.values() if e.even is not None]
    if not chunks:
        return
    if sum(chunks) > MAX_CHUNKS:
        raise FormatError(f"{where}: metadata.json's even splits claim more than {MAX_CHUNKS} stored shards")
    # sized by the ranks holding chunks (at most the rank stores), not by ``over``: ranks past the
    # last chunk write no chunk of any split (PackEnds keeps their listed shards apart)
    if max(chunks) <= _SMALL_SPLITS:
        return _replay_small(tensors, where, max(chunks))
    packs = PackEnds(max(chunks))
    for key in sorted(tensors):
        e = tensors[key]
        if e.even is not None:
            e.even.packed = packs.take_even(e.dtype, e.even.numels(e.global_shape), e.even.packed_from)
            continue
        for i, s in enumerate(e.shards):
            if s.packed is not None and packs.take(s.writer, e.dtype, s.numel) != s.packed:
                raise FormatError(f"{where}: metadata.json field tensors[{key!r}].shards[{i}].packed {s.packed} is "
                                  "not where the packing rule puts it (writer's packed shards in key order)")


_SMALL_SPLITS = 64  # at most this many chunks per split: replayed with plain ints (numpy per key cost ~5 µs)


def _replay_small(tensors: Mapping[str, Any], where: str, most: int) -> None:
    """:func:`replay_packs` where every even split has few chunks: the same rule (each writer's
    packed elements per dtype, a running sum in key order) kept in plain lists and dicts."""
    # dtype -> elements packed so far by writers below ``most`` (every even chunk's writer), by
    # position; listed shards of other writers in ``far`` (a list indexed by writer: no tuple keys per chunk)
    ends: Dict[str, List[int]] = {}
    far: Dict[Tuple[str, int], int] = {}
    for key in sorted(tensors):
        e = tensors[key]
        col = ends.get(e.dtype)
        if col is None:
            col = ends[e.dtype] = [0] * most
        even = e.even
        if even is not None:
            shape, first = e.global_shape, even.packed_from
            g0 = shape[0]
            rows = -(-g0 // even.over)
            n = -(-g0 // rows) if rows else 0
            per_row = math.prod(shape[1:]) if len(shape) > 1 else 1
            at = col[first:n]
            size = rows * per_row
            for i in range(first, n - 1):
                col[i] += size
            if first < n:
                col[n - 1] += (g0 - (n - 1) * rows) * per_row
            even.packed = np.array(at, dtype=np.int64)
            continue
        for i, s in enumerate(e.shards):
            if s.packed is None:
                continue
            w = s.writer
            end = col[w] if w < most else far.get((e.dtype, w), 0)
            if end != s.packed:
                raise FormatError(f"{where}: metadata.json field tensors[{key!r}].shards[{i}].packed {s.packed} is "
                                  "not where the packing rule puts it (writer's packed shards in key order)")
            if w < most:
                col[w] = end + s.numel
            else:
                far[(e.dtype, w)] = end + s.numel


Place = Tuple[str, int, Tuple[int, ...]]  # dtype, element offset in the pack array, shard shape


class PackedPlaces:
    """``(writer, path of a stored shard) -> (dtype, pack offset, shape)`` for an index's packed
    shards (``path_of(key, index)``: the storage layout's path). Listed shards are known at once;
    an even split's chunks of a writer on the first question about that writer, so a loader
    reading from a few writers never lists tensors x ranks shards."""

    def __init__(self, index: Any, path_of: Callable[[str, int], str]) -> None:
        self._path_of = path_of
        self._places: Dict[Tuple[int, str], Place] = {}
        self._even: List[Tuple[str, Any]] = []  # (key, entry) of even splits with packed chunks
        self._even_keys: Dict[str, Any] = {}  # the same, by key (``shard``)
        self._asked: Set[int] = set()
        for key, entry in (index.tensors.items() if index is not None else ()):
            if entry.even is not None:
                if entry.even.packed_from < chunks_count(entry.global_shape, entry.even.over):
                    self._even.append((key, entry))
                    self._even_keys[key] = entry
                continue
            for sh in entry.shards:
                if sh.packed is not None:
                    self._places[(sh.writer, path_of(key, sh.index))] = (entry.dtype, sh.packed, tuple(sh.shape))

    def _writer(self, writer: int) -> None:
        if not self._even or writer in self._asked:
            return
        for key, entry in self._even:
            for i, _, shape, packed in entry.even.chunks(entry.global_shape, writer, writer + 1):
                if packed is not None:
                    self._places[(writer, self._path_of(key, i))] = (entry.dtype, packed, shape)
        # marked after: readers in other threads share these places (another may fill them again, alike)
        self._asked.add(writer)

    def shard(self, writer: int, key: str, index: int) -> Optional[Place]:
        """The place of stored shard ``index`` of ``key`` in ``writer``'s pack (None: not packed there),
        as ``get((writer, path_of(key, index)))`` says, but an even split's chunk from its own rule
        (chunk i is shard i of writer i): no other key's chunks listed, no per-writer pass over the keys."""
        entry = self._even_keys.get(key)
        if entry is None:
            return self._places.get((writer, self._path_of(key, index)))
        if index != writer:
            return None
        for _, _, shape, packed in entry.even.chunks(entry.global_shape, index, index + 1):
            return None if packed is None else (entry.dtype, packed, shape)
        return None

    def get(self, handle: Tuple[int, str], default: Optional[Place] = None) -> Optional[Place]:
        self._writer(handle[0])
        return self._places.get(handle, default)

    def __contains__(self, handle: Tuple[int, str]) -> bool:
        self._writer(handle[0])
        return handle in self._places

    def __getitem__(self, handle: Tuple[int, str]) -> Place:
        self._writer(handle[0])
        return self._places[handle]
