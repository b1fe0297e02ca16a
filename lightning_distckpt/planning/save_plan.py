"""Who writes what: a deterministic function of the exchanged records, computed on every rank
(no extra communication), giving each unique shard exactly one writer."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Dict, List, Sequence, Tuple

from .metadata import (
    CheckpointIndex,
    ObjectEntry,
    ObjectRecord,
    ShardRecord,
    StoredObject,
    StoredShard,
    TensorEntry,
)


@dataclass
class SavePlan:
    """The checkpoint index to store, and for each rank the shards and objects it writes.

    ``writes[rank]`` lists ``(key, shard_id, index)``; the writing rank finds the data in its own
    state dict by ``(key, shard_id)``. ``bytes_per_rank`` is what each rank writes.
    """

    index: CheckpointIndex
    writes: Dict[int, List[Tuple[str, tuple, int]]] = field(default_factory=dict)
    object_writes: Dict[int, List[Tuple[str, Tuple[int, ...], int]]] = field(default_factory=dict)
    bytes_per_rank: Dict[int, int] = field(default_factory=dict)


def make_save_plan(
    tensor_records: Sequence[ShardRecord],
    object_records: Sequence[ObjectRecord],
    world_size: int,
    balance_writes: bool = True,
    pack_max_bytes: int = 0,
) -> SavePlan:
    """Plan the writes.

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
    holders: Dict[Tuple[str, tuple], List[ShardRecord]] = defaultdict(list)
    for r in tensor_records:
        holders[(r.key, r.shard_id)].append(r)

    load = [0] * world_size
    writer_of: Dict[Tuple[str, tuple], int] = {}
    # Largest first, then by key and id: identical order on every rank.
    order = sorted(holders, key=lambda k: (-holders[k][0].nbytes, k[0], k[1][0], k[1][1], k[1][2] or (0, 0)))
    for k in order:
        recs = holders[k]
        mains = [r.rank for r in recs if r.main]
        if not mains:
            continue  # validation reports the gap; with validation off, nothing to write
        if balance_writes:
            candidates = sorted({r.rank for r in recs})
            writer = min(candidates, key=lambda rk: (load[rk], rk))
        else:
            writer = min(mains)
        writer_of[k] = writer
        load[writer] += recs[0].nbytes

    plan = SavePlan(index=CheckpointIndex())
    by_key: Dict[str, List[Tuple[tuple, int]]] = defaultdict(list)
    for (key, sid), w in writer_of.items():
        by_key[key].append((sid, w))
    pack_end: Dict[Tuple[int, str], int] = defaultdict(int)  # (writer, dtype) -> elements packed so far
    for key in sorted(by_key):
        first = holders[(key, by_key[key][0][0])][0]
        entry = TensorEntry(first.global_shape, first.dtype)
        for i, (sid, writer) in enumerate(sorted(by_key[key], key=lambda t: (t[0][0], t[0][2] or (0, 0)))):
            offset, shape, flat = sid
            rec = holders[(key, sid)][0]
            packed = None
            if flat is None and 0 < rec.nbytes <= pack_max_bytes:
                packed = pack_end[(writer, rec.dtype)]
                pack_end[(writer, rec.dtype)] += rec.numel
            entry.shards.append(StoredShard(offset, shape, flat, writer, i, packed))
            plan.writes.setdefault(writer, []).append((key, sid, i))
        plan.index.tensors[key] = entry

    obj_by_key: Dict[str, Dict[tuple, ObjectRecord]] = defaultdict(dict)
    for r in object_records:
        if r.main and r.offset not in obj_by_key[r.key]:
            obj_by_key[r.key][r.offset] = r
    for key in sorted(obj_by_key):
        recs = obj_by_key[key]
        entry_o = ObjectEntry(next(iter(recs.values())).global_shape)
        for i, off in enumerate(sorted(recs)):
            writer = recs[off].rank
            entry_o.shards.append(StoredObject(off, writer, i))
            plan.object_writes.setdefault(writer, []).append((key, off, i))
        plan.index.objects[key] = entry_o
    plan.bytes_per_rank = {rk: b for rk, b in enumerate(load)}
    return plan
