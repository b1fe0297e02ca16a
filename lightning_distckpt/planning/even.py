"""Even dim-0 splits (FSDP / ZeRO-3 sharding), recognised so planning needs no record per rank.

FSDP-like sharding splits every tensor along dim 0 over all ranks: every rank's records differ
(by offset), so grouping ranks by identical records (``groups.py``) finds one group per rank and
the coordinator would receive, validate and plan tensors x ranks records. But such a record is a
function of the rank: chunk ``ceil(G0 / N)`` rows at ``rank * chunk``, the last chunks shorter.
Each rank marks the records that are exactly its chunk (``mark_even``); their digest leaves the
rank out, so all such ranks share one layout and the coordinator receives one record list.

A key is *even* when every record of it is such a chunk, marked on every rank holding a
non-empty chunk (ranks past the tensor's rows describe none), with one global shape and dtype:
those chunks tile the tensor exactly once by construction, so validation has nothing to check
and the plan is fixed (each rank writes its own chunk). The groups holding a marked record of
any other key (a rank missing, a rank describing something else) are expanded back to every
rank's own records (``resolve_even``), so validation reports exactly what it reports without
the marks.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Collection, Dict, FrozenSet, List, NamedTuple, Sequence, Set, Tuple

from .groups import RankRecords, RecordGroup
from .metadata import ShardRecord

Box = Tuple[Tuple[int, ...], Tuple[int, ...]]


def even_box(global_shape: Tuple[int, ...], position: int, size: int) -> Box:
    """Offset and shape of chunk ``position`` of ``size`` of an even dim-0 split (may be empty)."""
    rows = -(-global_shape[0] // size)
    lo = min(position * rows, global_shape[0])
    hi = min(lo + rows, global_shape[0])
    rest = tuple(global_shape[1:])
    return (lo,) + (0,) * len(rest), (hi - lo,) + rest


def _is_chunk(r: ShardRecord, size: int) -> bool:
    if r.flat is not None or not r.main or not r.global_shape:
        return False
    offset, shape = even_box(r.global_shape, r.rank, size)
    return shape[0] > 0 and r.offset == offset and r.shape == shape  # empty chunks stay ordinary records


def mark_even(records: RankRecords, size: int) -> RankRecords:
    """``records`` with the positions of its even-split chunks marked (none for one rank)."""
    if size < 2:
        return records
    even = tuple(i for i, r in enumerate(records.tensors) if _is_chunk(r, size))
    return records._replace(even=even, even_over=size if even else 0)


EvenKeys = Dict[str, List[Tuple[int, int]]]  # key -> (group, source) of its records; chunk index = rank


class Resolved(NamedTuple):
    """``resolve_even``'s answer: the groups to validate and plan, the records of each even key,
    and the ranks whose every marked record is of an even key (each can list its own chunks'
    writes: they need not be sent)."""

    groups: List[RecordGroup]
    even: EvenKeys
    derived: FrozenSet[int]


def resolve_even(groups: Sequence[RecordGroup], size: int) -> Resolved:
    """The groups to validate and plan, and the records of each even key.

    A marked record of a key that is not even (a tensor of one row on rank 0 looks like chunk 0;
    a rank missing): its group is replaced by one group per rank with that rank's own records,
    marked only where the key is even (so even keys stay even)."""
    marked = [set(g.records.even) if g.records.even_over == size else set() for g in groups]
    if not any(marked) and not any(g.records.even for g in groups):
        return Resolved(list(groups), {}, frozenset())  # nothing marked (TP / PP / DP layouts)
    entries: Dict[str, List[Tuple[int, int, bool]]] = {}  # key -> (group, source, marked) of its marked records
    unmarked: Set[str] = set()  # keys with a record not marked: not even, whatever their marked records
    for gi, g in enumerate(groups):
        marks = marked[gi]
        for source, r in enumerate(g.records.tensors):
            if source in marks:
                entries.setdefault(r.key, []).append((gi, source, True))
            else:
                unmarked.add(r.key)
    keys = {key for key, held in entries.items() if key not in unmarked and _covers(groups, held, size)}
    out: List[RecordGroup] = []
    derived: Set[int] = set()
    for gi, g in enumerate(groups):
        if all(g.records.tensors[i].key in keys for i in marked[gi]) and len(marked[gi]) == len(g.records.even):
            out.append(g)
            derived.update(g.ranks if marked[gi] else ())
        else:
            out += [RecordGroup(own_records(g.records, rank, size, keys), [rank]) for rank in g.ranks]
    even: EvenKeys = {key: [] for key in keys}
    for gi, g in enumerate(out):
        for source in g.records.even:
            even[g.records.tensors[source].key].append((gi, source))
    return Resolved(out, even, frozenset(derived))


def chunks_of(global_shape: Tuple[int, ...], size: int) -> int:
    """How many ranks hold a (non-empty) chunk of an even split: the first ones."""
    rows = -(-global_shape[0] // size)
    return -(-global_shape[0] // rows) if rows else 0


def _covers(groups: Sequence[RecordGroup], held: List[Tuple[int, int, bool]], size: int) -> bool:
    """The marked records of one key come once from every rank with a non-empty chunk (no other
    rank describes the key), with one global shape and dtype. (Every rank is in exactly one
    group: distinct groups of ranks below n whose sizes add up to n hold each of them once.)"""
    first = groups[held[0][0]].records.tensors[held[0][1]]
    shape, dtype = first.global_shape, first.dtype
    n = chunks_of(shape, size)
    groups_seen, ranks = set(), 0
    for gi, src, _ in held:  # one pass (a key per tensor: thousands of calls)
        g = groups[gi]
        r = g.records.tensors[src]
        if r.global_shape != shape or r.dtype != dtype or g.ranks[-1] >= n or gi in groups_seen:
            return False
        groups_seen.add(gi)
        ranks += len(g.ranks)
    return ranks == n


def own_records(records: RankRecords, rank: int, size: int, even: Collection[str] = ()) -> RankRecords:
    """What ``rank`` itself described, from its group's first rank's records; its records of
    ``even`` keys stay marked."""
    marked = set(records.even)
    tensors = []
    for i, r in enumerate(records.tensors):
        if i in marked:  # the chunk of the split the rank marked it for
            offset, shape = even_box(r.global_shape, rank, records.even_over)
            r = replace(r, offset=offset, shape=shape, rank=rank)
        elif r.rank != rank:
            r = replace(r, rank=rank)
        tensors.append(r)
    objects = [replace(o, rank=rank) if o.rank != rank else o for o in records.objects]
    kept = tuple(i for i in sorted(marked) if tensors[i].key in even) if records.even_over == size else ()
    return RankRecords(tensors, objects, kept, size if kept else 0)
