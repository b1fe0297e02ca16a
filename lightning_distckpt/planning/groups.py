"""Ranks with the same records: planning works once per layout, not once per rank.

Data-parallel replicas describe the same shards (same keys, offsets, shapes, main flags); only
the rank differs. A save sends the coordinator one digest per rank and the records of one rank
per distinct digest: with Megatron-like TP x PP x DP, TP x PP x 2 record lists (the first DP
replica holds the main replicas) instead of one per rank.
"""

from __future__ import annotations

import hashlib
import operator
from typing import Dict, List, NamedTuple, Sequence, Tuple

from .metadata import ObjectRecord, ShardRecord


class RankRecords(NamedTuple):
    """One rank's entries as planning sees them, in the order of its lists of tensors and objects.

    ``even``: positions of the tensor records that are this rank's chunk of an even dim-0 split
    over ``even_over`` ranks (``planning/even.py``); their digest leaves the rank's offset out, so
    FSDP-like ranks share one layout."""

    tensors: List[ShardRecord]
    objects: List[ObjectRecord]
    even: Tuple[int, ...] = ()
    even_over: int = 0


class RecordGroup(NamedTuple):
    """Ranks whose records are the same but for ``rank`` (and, for the positions in
    ``records.even``, for which chunk of the even split): ``records`` are those of ``ranks[0]``
    (the lowest), in its own order; ``ranks`` ascending."""

    records: RankRecords
    ranks: List[int]


_layout_fields = operator.attrgetter("key", "dtype", "global_shape", "offset", "shape", "flat", "main", "tie")


def layout_digest(records: RankRecords) -> str:
    """Digest of the records without their rank: equal exactly for ranks describing the same
    shards in the same order with the same main flags and ties (an even split's chunk counts as the
    same shard on every rank)."""
    h = hashlib.blake2b(digest_size=16)
    # the tie too (planning/aliases.py): ranks alike but for it grouped as one would hide its absence.
    # Each record's fields taken by attrgetter and the reprs joined in one update: a Python-level step
    # and a hash call per record cost more than the digest itself (10,000 tiny tensors).
    rows = list(map(_layout_fields, records.tensors))
    for i in records.even:
        r = records.tensors[i]
        rows[i] = (r.key, r.dtype, r.global_shape, "even", records.even_over, r.main, r.tie)
    h.update("".join(map(repr, rows)).encode())
    h.update(b"|objects|")
    for o in records.objects:
        h.update(repr((o.key, o.global_shape, o.offset, o.main)).encode())
    return h.hexdigest()


def representatives(digests: Sequence[str]) -> Dict[str, List[int]]:
    """digest -> the ranks that reported it (ascending); the first one sends its records."""
    ranks: Dict[str, List[int]] = {}
    for rank, d in enumerate(digests):
        ranks.setdefault(d, []).append(rank)
    return ranks


def groups_of(per_rank: Sequence[RankRecords]) -> List[RecordGroup]:
    """Every rank a group of its own (records all-gathered, or one process)."""
    return [RecordGroup(recs, [rank]) for rank, recs in enumerate(per_rank)]
