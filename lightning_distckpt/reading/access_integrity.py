"""``load(..., validate_access_integrity=True)``: Megatron-Core's load-time sharding check
(``validation.validate_sharding_integrity``) on the ranks' templates, before anything is read.

Per key, over every rank's template: dtype, global shape and whether the shards form a regular grid
(``axis_fragmentations``) agree, and so does the shard shape on a regular grid; there the main
replicas (``replica_id`` 0) access each chunk of the grid exactly once. Flattened pieces must cover
their chunk exactly once (our save's rule); a tensor split unevenly (``from_offsets``, no grid) is
checked for agreement only, as Megatron-Core leaves the rest to its reader. ShardedObjects: each
element of the object array has one main replica. Plain tensors and DTensors of the template are not
checked (Megatron-Core's templates have none; a DTensor's replica ids follow its own mesh).

Every rank gathers every rank's records and runs the same check, so a violation raises the same
ValidationError on every rank; a rank whose template cannot be described fails every rank alike."""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

from ..comm import Comm
from ..core.errors import ValidationError
from ..core.state_dict import apply_factories, collect
from ..planning.metadata import ObjectRecord, ShardRecord
from ..planning.validation import validate_object_records, validate_tensor_records

#: at most this many problems, and uncovered chunks per key, are spelled out in the error
_SHOWN = 20


class Access(NamedTuple):
    """One rank's ShardedTensor of the template: its record and, on a regular grid, the grid and its chunk."""

    record: ShardRecord
    grid: Optional[Tuple[int, ...]]  # axis_fragmentations; None: split unevenly (from_offsets)
    chunk: Optional[Tuple[int, ...]]  # local_chunk_offset_in_global()


def local_accesses(template: Any, rank: int) -> Tuple[List[Access], List[ObjectRecord]]:
    """What this rank's template asks for (factories expanded: their build_fn runs, as in the load)."""
    found = collect(apply_factories(template))
    tensors = []
    for st in found["tensors"]:
        grid = tuple(st.axis_fragmentations) if st.axis_fragmentations is not None else None
        regular = grid is not None and st.flattened_range is None and math.prod(st.local_shape) > 0
        chunk = tuple(st.local_chunk_offset_in_global()) if regular else None
        tensors.append(Access(ShardRecord.of(st, rank), grid, chunk))
    return tensors, [ObjectRecord.of(o, rank) for o in found["objects"]]


def check_access_integrity(template: Any, comm: Comm, where: str) -> None:
    """Raise on every rank alike where the ranks' templates do not access each shard exactly once
    (collective: every rank of ``comm`` calls it). ``where``: the checkpoint, for the message."""
    error: Optional[BaseException] = None
    mine: Tuple[List[Access], List[ObjectRecord]] = ([], [])
    try:
        mine = local_accesses(template, comm.rank)
    except Exception as e:  # agreed below: no rank is left waiting in the exchange
        error = e
    gathered = comm.agree(f"load from {where}: describing the template for validate_access_integrity", error, mine)
    accesses = [a for tensors, _ in gathered for a in tensors]
    objects = [o for _, objs in gathered for o in objs]
    problems = access_problems(accesses) + validate_object_records(objects)
    if problems:
        more = f"\n  ... and {len(problems) - _SHOWN} more" if len(problems) > _SHOWN else ""
        raise ValidationError(
            f"load from {where} (validate_access_integrity=True): the ranks' templates do not access every shard "
            "exactly once as a main replica (replica_id 0); nothing was read:\n  "
            + "\n  ".join(problems[:_SHOWN]) + more)


def access_problems(accesses: List[Access]) -> List[str]:
    """Every problem of the gathered tensor accesses, key by key in key order (the same on every rank)."""
    by_key: Dict[str, List[Access]] = defaultdict(list)
    for a in accesses:
        by_key[a.record.key].append(a)
    problems: List[str] = []
    for key in sorted(by_key):
        problems += _key_problems(key, sorted(by_key[key], key=lambda a: a.record.rank))
    return problems


def _disagree(key: str, what: str, values: List[Tuple[Any, int]]) -> Optional[str]:
    """A message where the ranks give ``key`` more than one ``what`` (values with their ranks)."""
    ranks: Dict[Any, List[int]] = defaultdict(list)
    for value, rank in values:
        if rank not in ranks[value]:
            ranks[value].append(rank)
    if len(ranks) < 2:
        return None
    return f"{key!r}: ranks disagree on {what}: " + "; ".join(f"{v} on ranks {r}" for v, r in ranks.items())


def _key_problems(key: str, accesses: List[Access]) -> List[str]:
    recs = [a.record for a in accesses]
    for what, values in (("global shape", [(r.global_shape, r.rank) for r in recs]),
                         ("dtype", [(r.dtype, r.rank) for r in recs]),
                         ("the grid of shards (axis_fragmentations; None: split unevenly)",
                          [(a.grid, a.record.rank) for a in accesses])):
        found = _disagree(key, what, values)
        if found:
            return [found]
    grid = accesses[0].grid
    if grid is None:
        return []  # split unevenly: Megatron-Core leaves coverage to its reader, and so do we
    if any(r.flat for r in recs):
        return validate_tensor_records(recs)  # flattened pieces: each chunk covered exactly once
    found = _disagree(key, "the shard shape of a regular grid", [(r.shape, r.rank) for r in recs])
    return [found] if found else _grid_problems(key, grid, accesses)


def _grid_problems(key: str, grid: Tuple[int, ...], accesses: List[Access]) -> List[str]:
    """Each chunk of ``grid`` accessed by exactly one main replica (Megatron-Core's access count)."""
    holders: Dict[Tuple[int, ...], List[int]] = defaultdict(list)
    for a in accesses:
        if a.record.main and a.chunk is not None:
            holders[a.chunk].append(a.record.rank)
    shape = accesses[0].record.shape
    problems = [f"{key!r}: chunk {c} (offset {_offset(c, shape)} shape {shape}) is accessed as a main replica by "
                f"ranks {ranks} (replica_id must differ)" for c, ranks in sorted(holders.items()) if len(ranks) > 1]
    if not all(shape):
        return problems  # an empty shard covers nothing: a grid of empty shards has nothing to cover
    inside = sum(1 for c in holders if len(c) == len(grid) and all(0 <= i < n for i, n in zip(c, grid)))
    uncovered = math.prod(grid) - inside
    # Only the first chunks of the grid are looked at: among any inside + _SHOWN of them at least _SHOWN (or all
    # the uncovered) are uncovered, so a grid of billions of chunks (a wrong axis_fragmentations) costs nothing.
    first = itertools.islice(itertools.product(*(range(n) for n in grid)), inside + _SHOWN)
    for c in [c for c in first if c not in holders][:_SHOWN]:
        problems.append(f"{key!r}: region at offset {_offset(c, shape)} shape {shape} of global shape "
                        f"{accesses[0].record.global_shape} (chunk {c} of grid {grid}) is accessed by no rank as a "
                        f"main replica (replica_id 0); templates on ranks {sorted({a.record.rank for a in accesses})}")
    if uncovered > _SHOWN:
        problems.append(f"{key!r}: ... and {uncovered - _SHOWN} more chunks accessed by no rank")
    return problems


def _offset(chunk: Tuple[int, ...], shape: Tuple[int, ...]) -> Tuple[int, ...]:
    return tuple(i * s for i, s in zip(chunk, shape))
