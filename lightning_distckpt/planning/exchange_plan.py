"""Who reads which chunk from storage and who receives it: a pure, deterministic function of the
chunk requests exchanged within a group, computed identically on every rank of the group.

A *chunk* is one requested shard (key, offset, shape, flattened range, dtype). Ranks that ask
for the same chunk (data-parallel replicas) share one storage read: one of them - the *reader*,
chosen to balance read bytes over the ranks needing chunks, never simply the lowest rank -
reads it and the others receive it over the group. Small chunks with the same reader and the
same receivers travel together in one bucket. The ops are ordered so that consecutive ops come
from different readers, spreading storage reads over the group from the first op on.
"""

from __future__ import annotations

import zlib
from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

from ..core.mapping import ShardedTensor
from .metadata import dtype_name

class ChunkId(NamedTuple):
    """The identity of the data a ShardedTensor asks for; replicas share it (plain data: exchanged)."""

    key: str
    offset: Tuple[int, ...]  # global offset
    shape: Tuple[int, ...]  # shard shape in global axes
    flat: Optional[Tuple[int, int]]  # flattened range
    dtype: str

LOCAL, BROADCAST, P2P = "local", "broadcast", "p2p"


def chunk_id(st: ShardedTensor) -> ChunkId:
    """The identity of the data a ShardedTensor asks for; replicas share it."""
    fr = st.flattened_range
    return ChunkId(st.key, tuple(st.global_offset), tuple(st.shard_shape), (fr.start, fr.stop) if fr else None,
                   dtype_name(st.dtype, st.key))


class ChunkRequest(NamedTuple):
    """One rank's request for a chunk, as exchanged (plain data: a pair, the chunk a plain tuple
    where it travelled as one)."""

    chunk: ChunkId
    nbytes: int


@dataclass(frozen=True)
class ExchangeOp:
    """Chunks read by ``src`` and delivered to every rank in ``needers`` (group ranks, src included).

    ``transport``: ``local`` (only src needs them: no communication), ``broadcast`` (every rank
    of the group needs them) or ``p2p`` (a subset: src sends to each other needer).
    """

    src: int
    chunks: Tuple[ChunkId, ...]
    sizes: Tuple[int, ...]  # bytes of each chunk
    needers: Tuple[int, ...]
    transport: str

    @property
    def nbytes(self) -> int:
        return sum(self.sizes)

    @property
    def receivers(self) -> Tuple[int, ...]:
        return tuple(r for r in self.needers if r != self.src)

    def involves(self, rank: int) -> bool:
        return rank in self.needers


@dataclass
class ExchangePlan:
    """The ops in the order every rank posts them, and the bytes each rank reads from storage."""

    ops: List[ExchangeOp] = field(default_factory=list)
    read_bytes: Dict[int, int] = field(default_factory=dict)
    requested_bytes: int = 0  # sum over ranks of what they asked for (every-rank-reads would read this)

    @property
    def unique_bytes(self) -> int:
        return sum(self.read_bytes.values())

    def ops_for(self, rank: int) -> List[ExchangeOp]:
        return [op for op in self.ops if op.involves(rank)]


def _sort_key(c: ChunkId) -> tuple:
    key, offset, shape, flat, dtype = c
    return (key, offset, shape, flat or (-1, -1), dtype)


def _spread_start(c: ChunkId, size: int) -> int:
    """A stable pseudo-random rank to start tie-breaking from (crc32, not hash(): that differs per process)."""
    return zlib.crc32(repr(c).encode()) % max(1, size)


def plan_exchange(requests: Sequence[Sequence[ChunkRequest]], *, bucket_bytes: int = 256 << 10) -> ExchangePlan:
    """Plan reads and deliveries for a group whose rank ``r`` asked for ``requests[r]``.

    Readers are chosen greedily, largest chunk first, as the needer with the fewest bytes read so
    far; ties go to the needer first reached from a per-chunk pseudo-random rank, so equal loads
    do not pile onto rank 0. Chunks smaller than ``bucket_bytes`` are bucketed (same reader and
    needers, at most ``bucket_bytes`` per bucket).
    """
    size = len(requests)
    # Each distinct chunk numbered once (a ChunkId's hash walks its nested tuples on every dict use):
    # its needers (ascending: ranks are visited in order), bytes and sort key by number.
    number: Dict[ChunkId, int] = {}
    chunks: List[ChunkId] = []
    nbytes: List[int] = []
    needers: List[List[int]] = []
    requested = 0
    for rank, reqs in enumerate(requests):
        for chunk, n in reqs:  # ChunkRequests, or (chunk, nbytes) pairs as gathered
            i = number.get(chunk)
            if i is None:
                number[chunk] = len(chunks)
                chunks.append(chunk)
                nbytes.append(n)
                needers.append([rank])
            else:
                nbytes[i] = n
                if needers[i][-1] != rank:
                    needers[i].append(rank)
            requested += n

    load = [0] * size
    reader = [0] * len(chunks)
    sort_keys = [_sort_key(c) for c in chunks]
    in_order = sorted(range(len(chunks)), key=sort_keys.__getitem__)
    # largest first, ties in chunk order (a stable sort of the sorted chunks: one sort key per chunk)
    for i in sorted(in_order, key=nbytes.__getitem__, reverse=True):
        who = needers[i]
        if len(who) == 1:  # no choice (no tie to break): the only needer reads it
            reader[i] = who[0]
        else:
            start = _spread_start(chunks[i], size)
            reader[i] = min(who, key=lambda rk: (load[rk], (rk - start) % size))
        load[reader[i]] += nbytes[i]

    # Group into ops: big chunks alone, small ones bucketed by (reader, needers).
    per_src: Dict[int, List[ExchangeOp]] = defaultdict(list)
    buckets: Dict[Tuple[int, Tuple[int, ...]], List[int]] = defaultdict(list)
    for i in in_order:
        who = tuple(needers[i])
        if nbytes[i] >= bucket_bytes:
            per_src[reader[i]].append(_op(reader[i], [i], chunks, nbytes, who, size))
        else:
            buckets[(reader[i], who)].append(i)
    for (src, who), numbers in sorted(buckets.items()):
        current: List[int] = []
        filled = 0  # bytes of ``current`` (a running sum: summing it per chunk was quadratic in its length)
        for i in numbers:
            if current and filled + nbytes[i] > bucket_bytes:
                per_src[src].append(_op(src, current, chunks, nbytes, who, size))
                current, filled = [], 0
            current.append(i)
            filled += nbytes[i]
        if current:
            per_src[src].append(_op(src, current, chunks, nbytes, who, size))

    # Interleave the readers: next op from the reader with the fewest bytes scheduled so far,
    # so every reader starts at once and they progress at the same pace.
    plan = ExchangePlan(read_bytes={rk: load[rk] for rk in range(size)}, requested_bytes=requested)
    queues = {src: deque(ops) for src, ops in per_src.items()}
    scheduled = {src: 0 for src in queues}
    while queues:
        src = min(queues, key=lambda s: (scheduled[s], s))
        op = queues[src].popleft()
        plan.ops.append(op)
        scheduled[src] += op.nbytes
        if not queues[src]:
            del queues[src]
    return plan


def _op(src: int, numbers: List[int], chunks: List[ChunkId], nbytes: List[int], who: Tuple[int, ...],
        size: int) -> ExchangeOp:
    """The op of the chunks numbered ``numbers`` (in :func:`plan_exchange`'s numbering)."""
    transport = LOCAL if len(who) == 1 else BROADCAST if len(who) == size else P2P
    return ExchangeOp(src, tuple([chunks[i] for i in numbers]), tuple([nbytes[i] for i in numbers]), who, transport)

