"""Checks on the exchanged shard records of all ranks, run identically on every rank before
anything is written, so a violation fails everywhere with the same message."""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import replace
from typing import Collection, Dict, Iterable, List, Sequence, Tuple, TypeVar

from ..core.errors import ValidationError
from ..storage.key_paths import colliding_keys, collision_reason
from .boxes import Box
from .groups import RecordGroup
from .tiling import overlapping_pairs
from .metadata import CheckpointIndex, ObjectRecord, ShardRecord


def _ranks(records: Iterable[ShardRecord]) -> List[int]:
    return sorted({r.rank for r in records})


R = TypeVar("R", ShardRecord, ObjectRecord)


def _by_key(records: Sequence[R]) -> List[Tuple[str, List[R]]]:
    """The records grouped by key, in key order (every rank reports problems in the same order)."""
    by_key: Dict[str, List[R]] = defaultdict(list)
    for r in records:
        by_key[r.key].append(r)
    return sorted(by_key.items())


def validate_tensor_records(records: Sequence[ShardRecord]) -> List[str]:
    """Return every problem found (empty list = consistent).

    Per key: global shape and dtype agree on all ranks; main replicas are unique; the main
    replicas tile the global tensor exactly once (no gap, no overlap); flattened ranges of a
    shard cover it exactly once.
    """
    return [p for key, recs in _by_key(records) for p in _tensor_problems(key, recs)]


def validate_record_groups(groups: Sequence[RecordGroup], even: Collection[str] = ()) -> List[str]:
    """What :func:`validate_tensor_records` and :func:`validate_object_records` find in the records
    of every rank of ``groups``, reading each group's records once: main replicas count once per
    rank of their group (two ranks cannot both hold a main replica), the others once. A key with a
    problem is checked again with every rank's records, so its messages name every rank. Keys in
    ``even`` (``planning/even.resolve_even``) tile their tensor by construction: not checked."""
    held: Dict[str, List[Tuple[ShardRecord, List[int]]]] = defaultdict(list)
    for g in groups:
        for r in g.records.tensors:
            if r.key not in even:
                held[r.key].append((r, g.ranks))
    problems: List[str] = []
    # Whether a key has problems depends only on its records without key and ranks (how many
    # ranks hold each main replica aside): the 96 layers of a model repeat a few such layouts,
    # so a layout found consistent once is not checked again.
    consistent = set()
    for key in sorted(held):
        layout = tuple((r.global_shape, r.dtype, r.offset, r.shape, r.flat, r.main, len(ranks) if r.main else 1)
                       for r, ranks in held[key])
        if layout in consistent:
            continue
        found = _tensor_problems(key, _per_rank(held[key], every_rank=False))
        if not found:
            consistent.add(layout)
        if found and any(len(ranks) > 1 and not r.main for r, ranks in held[key]):
            found = _tensor_problems(key, _per_rank(held[key], every_rank=True))
        problems += found
    objects = [replace(o, rank=rank) if rank != o.rank else o
               for g in groups for o in g.records.objects for rank in (g.ranks if o.main else g.ranks[:1])]
    return problems + validate_object_records(sorted(objects, key=lambda o: o.rank))


def _per_rank(held: List[Tuple[ShardRecord, List[int]]], every_rank: bool) -> List[ShardRecord]:
    """The records of each holding rank (non-main ones only for the group's first rank unless
    ``every_rank``), in rank order as an all-gather lists them."""
    out = [replace(r, rank=rank) if rank != r.rank else r
           for r, ranks in held for rank in (ranks if r.main or every_rank else ranks[:1])]
    return sorted(out, key=lambda r: r.rank)


DUPLICATE_MAIN = "(replica_id must differ)"


def _tensor_problems(key: str, recs: List[ShardRecord]) -> List[str]:
    """One key's problems (its records in rank order)."""
    problems: List[str] = []
    shapes = {r.global_shape for r in recs}
    dtypes = {r.dtype for r in recs}
    if len(shapes) > 1:
        detail = {s: _ranks(r for r in recs if r.global_shape == s) for s in shapes}
        problems.append(f"{key!r}: ranks disagree on global shape: "
                        + "; ".join(f"{s} on ranks {rk}" for s, rk in detail.items()))
        return problems
    if len(dtypes) > 1:
        detail = {d: _ranks(r for r in recs if r.dtype == d) for d in dtypes}
        problems.append(f"{key!r}: ranks disagree on dtype: "
                        + "; ".join(f"{d} on ranks {rk}" for d, rk in detail.items()))
        return problems
    (global_shape,) = shapes
    # An empty shard (a rank holding no elements of an unevenly split tensor) covers nothing: it
    # cannot overlap or fill a gap, and several ranks may hold it at one offset (Megatron-Core
    # accepts them); one of its holders is picked to write it like any shard.
    mains = [r for r in recs if r.main and r.numel]
    seen: Dict[tuple, int] = {}
    for r in mains:
        if r.shard_id in seen:
            problems.append(
                f"{key!r}: shard at offset {r.offset} shape {r.shape}"
                + (f" flat {r.flat}" if r.flat else "")
                + f" is a main replica on ranks {seen[r.shard_id]} and {r.rank} {DUPLICATE_MAIN}"
            )
        else:
            seen[r.shard_id] = r.rank
    # Group flattened pieces by the non-flat shard they cut.
    boxes: Dict[Box, List[ShardRecord]] = defaultdict(list)
    for r in mains:
        boxes[(r.offset, r.shape)].append(r)
    for (off, shape), pieces in boxes.items():
        problems += _flat_problems(key, off, shape, pieces)
    box_list = sorted(boxes)
    for i, j in overlapping_pairs(box_list):
        (ao, ash), (bo, bsh) = box_list[i], box_list[j]
        problems.append(
            f"{key!r}: main replicas overlap: offset {ao} shape {ash} (ranks {_ranks(boxes[(ao, ash)])}) and "
            f"offset {bo} shape {bsh} (ranks {_ranks(boxes[(bo, bsh)])})"
        )
    covered = sum(math.prod(s) for _, s in box_list)
    total = math.prod(global_shape)
    if covered < total:
        problems.append(
            f"{key!r}: main replicas cover {covered} of {total} elements of global shape {global_shape} "
            f"(a gap: some part has no replica with replica_id 0; shards held by ranks {_ranks(recs)})"
        )
    return problems


def _flat_problems(key: str, off: Tuple[int, ...], shape: Tuple[int, ...], pieces: List[ShardRecord]) -> List[str]:
    """The flattened pieces of the main shard at ``off`` cover it exactly once (none: whole)."""
    flat = [p for p in pieces if p.flat]
    if not flat:
        return []
    if len(flat) != len(pieces):
        return [f"{key!r}: shard at offset {off} is saved both flattened and whole"]
    covered = 0
    for p in sorted(flat, key=lambda p: p.flat):
        if p.flat[0] != covered:
            kind = "gap" if p.flat[0] > covered else "overlap"
            return [f"{key!r}: flattened ranges of shard at offset {off} have a {kind} at element "
                    f"{min(covered, p.flat[0])} (rank {p.rank} holds {p.flat[0]}:{p.flat[1]})"]
        covered = p.flat[1]
    if covered != math.prod(shape):
        return [f"{key!r}: flattened ranges of shard at offset {off} cover {covered} of {math.prod(shape)} elements"]
    return []


def validate_object_records(records: Sequence[ObjectRecord]) -> List[str]:
    """Per key: one global shape, unique main replicas, every element of the object array present."""
    problems: List[str] = []
    for key, recs in _by_key(records):
        shapes = {r.global_shape for r in recs}
        if len(shapes) > 1:
            problems.append(f"{key!r}: ranks disagree on ShardedObject global shape: {sorted(shapes)}")
            continue
        seen: Dict[tuple, int] = {}
        for r in recs:
            if not r.main:
                continue
            if r.offset in seen:
                problems.append(f"{key!r}: ShardedObject at offset {r.offset} is a main replica on ranks "
                                f"{seen[r.offset]} and {r.rank}")
            seen[r.offset] = r.rank
        (shape,) = shapes
        if len(seen) < math.prod(shape):
            problems.append(
                f"{key!r}: ShardedObject array of shape {shape} has main replicas for only {len(seen)} elements"
            )
    return problems


def key_path_problems(index: CheckpointIndex) -> List[str]:
    """Two tensor keys, or two object keys, of the index to save that the storage layout would
    store at one path (``storage/key_paths.py``). Checked on every save, whatever
    ``validate_access_integrity`` says: the second would overwrite or shadow the first."""
    return [f"{kind} {a!r} and {b!r} cannot both be saved: {collision_reason(a, b)}; rename one of them"
            for kind, keys in (("tensors", index.tensors), ("objects", index.objects))
            for a, b in colliding_keys(keys)]


#: Said once under duplicated main replicas: a DTensor's replica id comes from its own mesh, so one on a sub-mesh
#: held again by other ranks (FSDP2 over a 2-D mesh's data_parallel dim, a parameter left out of TP) is main on
#: each copy; only the caller knows whether the copies hold the same values.
SUB_MESH_HINT = (
    "if these are DTensors: a DTensor on a sub-mesh (FSDP2 over the data_parallel dim of a 2-D mesh, a parameter "
    "left out of tensor parallelism) is main on every copy of that sub-mesh: save it through "
    "DistCheckpointModelParallelStrategy / FabricDistCheckpointModelParallelStrategy, or give it as a ShardedTensor "
    "(lightning_distckpt.core.dtensors.dtensor_to_sharded) with a nonzero replica_id on all copies but one"
)


def raise_on_problems(problems: List[str], checkpoint_dir: str) -> None:
    if problems:
        shown = problems[:20]
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        hint = f"\n  ({SUB_MESH_HINT})" if any(p.endswith(DUPLICATE_MAIN) for p in problems) else ""
        raise ValidationError(
            f"sharded state dict for checkpoint {checkpoint_dir} is inconsistent; nothing was written:\n  "
            + "\n  ".join(shown)
            + more
            + hint
        )
