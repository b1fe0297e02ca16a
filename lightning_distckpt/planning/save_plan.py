"""Who writes what: a deterministic function of every rank's records, giving each unique shard
exactly one writer (computed by the save's coordinator, or by every rank from an all-gather)."""

from __future__ import annotations

import functools
import heapq
from collections import defaultdict
from dataclasses import dataclass, field
from typing import AbstractSet, Dict, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from .even import EvenKeys, even_box
from .even_index import EvenSplit, PackEnds
from .metadata import (
    CheckpointIndex,
    element_size,
    FlatRange,
    ObjectEntry,
    ObjectRecord,
    ShardRecord,
    StoredObject,
    StoredShard,
    TensorEntry,
)
from .groups import RankRecords, RecordGroup, groups_of

ShardId = Tuple[Tuple[int, ...], Tuple[int, ...], FlatRange]  # ShardRecord.shard_id: (offset, shape, flat)


class WriteItem(NamedTuple):
    """One stored shard and the rank that writes it.

    ``index``: the shard's number among the key's stored shards; ``packed``: its element offset in
    the writer's pack array of its dtype (None: an array of its own); ``source``: the position of
    the writer's record among that rank's own tensor records, i.e. of the ShardedTensor holding
    the data in the writer's list, so the writer finds it without a lookup.
    """

    key: str
    shard_id: ShardId
    index: int
    packed: Optional[int]
    source: int


class ObjectWriteItem(NamedTuple):
    """One ShardedObject element and the rank that writes it (``source``: the position of its
    record among the writer's own object records)."""

    key: str
    offset: Tuple[int, ...]
    index: int
    source: int


@dataclass
class SavePlan:
    """The checkpoint index to store, and for each rank the shards and objects it writes.

    ``writes[rank]`` / ``object_writes[rank]`` list what ``rank`` writes, in index order;
    ``bytes_per_rank`` is what each rank writes.
    """

    index: CheckpointIndex
    writes: Dict[int, List[WriteItem]] = field(default_factory=dict)
    object_writes: Dict[int, List[ObjectWriteItem]] = field(default_factory=dict)
    bytes_per_rank: Dict[int, int] = field(default_factory=dict)


class _Held(NamedTuple):
    """A record of a group's first rank, its position among that rank's records, and the group
    (by its position among the groups; each of its ranks holds the same record there)."""

    record: ShardRecord
    source: int
    group: int


def make_save_plan(
    tensor_records: Sequence[ShardRecord],
    object_records: Sequence[ObjectRecord],
    world_size: int,
    balance_writes: bool = True,
    pack_max_bytes: int = 0,
) -> SavePlan:
    """Plan the writes.

    Each rank's records must appear in the order of that rank's own list of tensors (objects):
    a write's ``source`` is the position of its record among its writer's records. Ranks may be
    interleaved (an all-gather's concatenation is the usual input).

    Every unique shard (same key, offset, shape, flattened range) is written once. With
    ``balance_writes`` its writer is chosen among all ranks holding a replica of it, greedily,
    largest shards first, to the holder with the fewest bytes so far (ties: lowest rank), so
    replicated (data-parallel) state is written by all its holders in parallel. Without it,
    the main replica (replica_id all zeros) writes.

    Shards of at most ``pack_max_bytes`` (not empty, not flattened) are packed: each writer stores
    its small shards of one dtype back to back in one array, at the element offsets set here
    (``StoredShard.packed``). A model's hundreds of norms and biases then cost a few arrays per
    rank instead of one each. 0 (the default here) packs nothing; saves pass
    ``StorageOptions.pack_max_bytes``.
    """
    per_rank = [RankRecords([], []) for _ in range(world_size)]
    for r in tensor_records:
        per_rank[r.rank].tensors.append(r)
    for o in object_records:
        per_rank[o.rank].objects.append(o)
    return plan_record_groups(groups_of(per_rank), world_size, balance_writes, pack_max_bytes)


def plan_record_groups(groups: Sequence[RecordGroup], world_size: int, balance_writes: bool = True,
                       pack_max_bytes: int = 0, even: Optional[EvenKeys] = None,
                       derived: AbstractSet[int] = frozenset(), aliases: Optional[Dict[str, str]] = None) -> SavePlan:
    """:func:`make_save_plan` of every rank's records, given as groups of ranks with the same
    records (the same plan; its cost grows with the groups' records, not with the ranks).

    The chunks of ``even`` keys (``planning/even.resolve_even``) are written by their own rank,
    chunk i of a key being its stored shard i; their bytes count before the other shards'
    writers are picked. The ranks in ``derived`` list their chunks' writes themselves
    (:func:`with_even_chunks`): ``writes`` leaves them out. The keys of ``aliases`` (alias -> target,
    ``planning/aliases.py``) are not written: the index serves each from its target's shards."""
    aliases = aliases or {}
    even = {k: v for k, v in even.items() if k not in aliases} if aliases and even else (even or {})
    holders: Dict[Tuple[str, ShardId], List[_Held]] = defaultdict(list)
    mains = set()  # the shards with a main replica
    held_new = tuple.__new__  # _Held(...) without its Python-level __new__: tens of thousands of records
    for gi, g in enumerate(groups):
        for source, r in enumerate(g.records.tensors):
            if r.key not in even and r.key not in aliases:
                k = (r.key, (r.offset, r.shape, r.flat))
                holders[k].append(held_new(_Held, (r, source, gi)))
                if r.main:
                    mains.add(k)
    load = _even_load(groups, even, world_size)
    itemsize = {dtype: element_size(dtype) for dtype in {held[0].record.dtype for held in holders.values()}}
    nbytes = {k: held[0].record.numel * itemsize[held[0].record.dtype] for k, held in holders.items()}
    writer_of = _assign_writers(holders, nbytes, groups, load, balance_writes, mains)
    plan = SavePlan(index=CheckpointIndex(), bytes_per_rank=dict(enumerate(load)))
    _plan_tensors(plan, holders, writer_of, nbytes, pack_max_bytes, _EvenPart(groups, even, world_size, derived))
    _plan_objects(plan, groups)
    if aliases:
        plan.index.aliases = dict(aliases)
        for key, target in aliases.items():  # as a reader's index has them (CheckpointIndex.from_json)
            plan.index.tensors[key] = plan.index.tensors[target]
    return plan


def _even_load(groups: Sequence[RecordGroup], even: EvenKeys, world_size: int) -> List[int]:
    """Bytes each rank writes of the even keys' chunks (rank i chunk i)."""
    # Keys counted per (global shape, dtype), then one numpy step per distinct pair: thousands of keys
    # share a few shapes, and a numpy call per key costs microseconds.
    alike: Dict[Tuple[Tuple[int, ...], str], int] = defaultdict(int)
    for chunks in even.values():
        r = groups[chunks[0][0]].records.tensors[chunks[0][1]]
        alike[(r.global_shape, r.dtype)] += 1
    load = np.zeros(world_size, dtype=np.int64)
    for (global_shape, dtype), keys in alike.items():
        numels = _even_numels(global_shape, world_size)
        load[:len(numels)] += numels * (element_size(dtype) * keys)
    return load.tolist()


# Per distinct shape, not per key: thousands of keys share a few shapes (norms, biases, tiny tensors),
# and each numpy call costs microseconds. Read-only results, bounded caches.
@functools.lru_cache(maxsize=4096)
def _even_numels(global_shape: Tuple[int, ...], size: int) -> np.ndarray:
    numels = EvenSplit(size, 0).numels(global_shape)
    numels.flags.writeable = False
    return numels


@functools.lru_cache(maxsize=4096)
def _even_rule(global_shape: Tuple[int, ...], size: int, itemsize: int, pack_max_bytes: int) -> int:
    """The first packed chunk of ``global_shape``'s even split (:meth:`EvenSplit.of`)."""
    return EvenSplit.of(global_shape, size, itemsize, pack_max_bytes).packed_from


_even_box = functools.lru_cache(maxsize=1 << 16)(even_box)


def _assign_writers(
    holders: Dict[Tuple[str, ShardId], List[_Held]], nbytes: Dict[Tuple[str, ShardId], int],
    groups: Sequence[RecordGroup], load: List[int], balance_writes: bool, mains: AbstractSet[Tuple[str, ShardId]],
) -> Dict[Tuple[str, ShardId], Tuple[_Held, int]]:
    """The writing rank (and its group's record) of every shard with a main replica (``mains``);
    ``load`` (bytes each rank writes) grows by each shard's bytes."""
    group_of = [0] * len(load)
    for gi, g in enumerate(groups):
        for rk in g.ranks:
            group_of[rk] = gi
    writer_of: Dict[Tuple[str, ShardId], Tuple[_Held, int]] = {}
    fewest = _FewestBytes(load, groups)
    # Largest first, then by key and id: identical order on every rank.
    order = sorted(holders, key=lambda k: (-nbytes[k], k[0], k[1][0], k[1][1], k[1][2] or (0, 0)))
    for k in order:
        held = holders[k]
        if len(held) == 1:  # one group holds it (most shards): no search among holders
            h = held[0]
            if not h.record.main:
                continue
            ranks = groups[h.group].ranks
            writer = ranks[0] if len(ranks) == 1 or not balance_writes else fewest.pick(held, nbytes[k])
            writer_of[k] = (h, writer)
            load[writer] += nbytes[k]
            continue
        if balance_writes:
            if k not in mains:
                continue  # validation reports the gap; with validation off, nothing to write
            writer = fewest.pick(held, nbytes[k])
        else:
            mains = [groups[h.group].ranks[0] for h in held if h.record.main]
            if not mains:
                continue
            writer = min(mains)
        gi = group_of[writer]
        writer_of[k] = ([h for h in held if h.group == gi][0], writer)
        load[writer] += nbytes[k]
    return writer_of


class _FewestBytes:
    """The holder with the fewest bytes so far (ties: lowest rank), without visiting every
    holder of every shard: one heap of (bytes, rank) per set of holding groups, refreshed lazily
    (bytes only grow, so an entry whose rank wrote since it was pushed is pushed again)."""

    def __init__(self, load: List[int], groups: Sequence[RecordGroup]) -> None:
        self._load = load
        self._groups = groups
        self._heaps: Dict[Tuple[int, ...], List[Tuple[int, int]]] = {}

    def pick(self, held: Sequence[_Held], nbytes: int) -> int:
        """The holder that writes a shard of ``nbytes`` (its entry is pushed with them added)."""
        ident = tuple([h.group for h in held])  # in group order, as the holders were listed
        heap = self._heaps.get(ident)
        if heap is None:
            heap = [(self._load[rk], rk) for gi in dict.fromkeys(ident) for rk in self._groups[gi].ranks]
            heapq.heapify(heap)
            self._heaps[ident] = heap
        load = self._load
        while heap[0][0] != load[heap[0][1]]:
            rk = heap[0][1]
            heapq.heapreplace(heap, (load[rk], rk))
        rk = heap[0][1]
        heapq.heapreplace(heap, (load[rk] + nbytes, rk))
        return rk


class _EvenPart(NamedTuple):
    groups: Sequence[RecordGroup]
    keys: EvenKeys
    world_size: int
    derived: AbstractSet[int]


def _plan_tensors(plan: SavePlan, holders: Dict[Tuple[str, ShardId], List[_Held]],
                  writer_of: Dict[Tuple[str, ShardId], Tuple[_Held, int]], nbytes: Dict[Tuple[str, ShardId], int],
                  pack_max_bytes: int, even: _EvenPart) -> None:
    """Index entries in key order, stored shards numbered by offset, small shards packed (each
    writer's of one dtype back to back in that order: ``even_index.py``'s packing rule)."""
    by_key: Dict[str, List[Tuple[ShardId, Tuple[_Held, int], int]]] = defaultdict(list)
    for k, chosen in writer_of.items():
        by_key[k[0]].append((k[1], chosen, nbytes[k]))
    packs = PackEnds(even.world_size)
    writes, new_write = plan.writes, tuple.__new__
    writers: Dict[int, List[int]] = {}  # group -> its ranks that are given their even chunks' writes
    for key in sorted(set(by_key) | set(even.keys)):
        if key in even.keys:
            plan.index.tensors[key] = _plan_even_key(plan, key, even, pack_max_bytes, packs, writers)
            continue
        shards = by_key[key]
        first = shards[0][1][0].record
        entry = TensorEntry(first.global_shape, first.dtype)
        if len(shards) > 1:
            shards.sort(key=lambda t: (t[0][0], t[0][2] or (0, 0)))
        for i, (sid, (held, writer), size) in enumerate(shards):
            rec = held.record
            packed = None
            if 0 < size <= pack_max_bytes and rec.flat is None:
                packed = packs.take(writer, rec.dtype, rec.numel)
            entry.shards.append(StoredShard(rec.offset, rec.shape, rec.flat, writer, i, packed))
            # WriteItem(...) without its Python-level __new__ (one per stored shard)
            writes.setdefault(writer, []).append(new_write(WriteItem, (key, sid, i, packed, held.source)))
        plan.index.tensors[key] = entry


def _plan_even_key(plan: SavePlan, key: str, even: _EvenPart, pack_max_bytes: int, packs: PackEnds,
                   writers: Dict[int, List[int]]) -> TensorEntry:
    """An even key's entry (rank i writes chunk i, stored shard i: the rule, ``even_index.py``)
    and the writes of its ranks not in ``even.derived``."""
    chunks, size = even.keys[key], even.world_size
    first = even.groups[chunks[0][0]].records.tensors[chunks[0][1]]
    gshape, dtype = first.global_shape, first.dtype
    split = EvenSplit(size, _even_rule(gshape, size, element_size(dtype), pack_max_bytes))
    split.packed = packs.take_even(dtype, _even_numels(gshape, size), split.packed_from)
    packed_at = None  # the pack offsets as ints, converted once per key, where a rank here needs one
    for gi, src in chunks:
        ranks = writers.get(gi)
        if ranks is None:
            ranks = writers[gi] = [rank for rank in even.groups[gi].ranks if rank not in even.derived]
        for rank in ranks:
            offset, shape = _even_box(gshape, rank, size)
            packed = None
            if rank >= split.packed_from:
                if packed_at is None:
                    packed_at = split.packed.tolist()
                packed = packed_at[rank - split.packed_from]
            # WriteItem(...) without its Python-level __new__ (one per chunk listed here)
            plan.writes.setdefault(rank, []).append(tuple.__new__(WriteItem, (key, (offset, shape, None), rank,
                                                                              packed, src)))
    return TensorEntry(gshape, dtype, even=split)


def _plan_objects(plan: SavePlan, groups: Sequence[RecordGroup]) -> None:
    """Each object element is written by the lowest rank holding a main replica of it."""
    obj_by_key: Dict[str, Dict[Tuple[int, ...], Tuple[ObjectRecord, int, int]]] = defaultdict(dict)
    for g in sorted(groups, key=lambda g: g.ranks[0]):
        for source, r in enumerate(g.records.objects):
            if r.main and r.offset not in obj_by_key[r.key]:
                obj_by_key[r.key][r.offset] = (r, source, g.ranks[0])
    for key in sorted(obj_by_key):
        recs = obj_by_key[key]
        entry = ObjectEntry(next(iter(recs.values()))[0].global_shape)
        for i, off in enumerate(sorted(recs)):
            _, source, writer = recs[off]
            entry.shards.append(StoredObject(off, writer, i))
            plan.object_writes.setdefault(writer, []).append(ObjectWriteItem(key, off, i, source))
        plan.index.objects[key] = entry


def with_even_chunks(writes: List[WriteItem], records: RankRecords, rank: int, pack_max_bytes: int,
                     aliases: AbstractSet[str] = frozenset()) -> List[WriteItem]:
    """This rank's writes: ``writes`` (from the plan) and one per marked chunk (``records.even``:
    chunk ``rank`` of its key, stored shard ``rank``), in key order as the plan lists them, small
    ones packed as the plan packs them (after the writer's packed shards of earlier keys)."""
    mine = [WriteItem(r.key, (r.offset, r.shape, None), rank, None, i)
            for i, r in ((i, records.tensors[i]) for i in records.even) if r.key not in aliases]
    out: List[WriteItem] = []
    pack_end: Dict[str, int] = defaultdict(int)  # dtype -> elements packed so far
    for item in sorted(writes + mine, key=lambda w: (w.key, w.index)):
        rec = records.tensors[item.source]
        if rec.flat is None and 0 < rec.nbytes <= pack_max_bytes:
            if item.packed is None:  # a chunk listed here: the next place in the pack
                item = item._replace(packed=pack_end[rec.dtype])
            pack_end[rec.dtype] = item.packed + rec.numel
        out.append(item)
    return out
