"""The warning that the common (non-sharded) state differs between ranks: only rank 0's copy is saved.

Megatron-Core logs it at every save (its per-rank line is kept to the letter). A run that saves every few
steps through one :class:`~.save_prepare.SavePlanCache` (the Lightning plugin and strategies, an
:class:`AsyncSaver`) says it once per set of differences: a ``ModelCheckpoint`` whose monitor is logged
without ``sync_dist`` has a ``best_model_path`` that differs by rank at every save, and stock Lightning,
which also saves rank 0's, says nothing at all.
"""

from __future__ import annotations

import logging
from typing import Any, Optional, Set, Tuple

from ..comm import Comm
from ..planning.common_check import common_differences, leaf_records, rank_differences

logger = logging.getLogger(__name__)


def warn_common_differs(common: Any, comm: Comm, target: str, warned: Optional[Set[Tuple[str, ...]]] = None) -> None:
    """Collective (entered by every rank: all saw the same digests): find and log, on rank 0, the
    common-state leaves that differ between ranks, and on each rank that differs from rank 0 its own
    line (Megatron-Core's). Not an error: the save goes on with rank 0's. ``warned``: the differences
    already said in this run (every rank decides alike: all gathered the same leaves); None: every time."""
    per_rank = comm.all_gather_object(leaf_records(common))
    digests = [{path: leaf.digest for path, leaf in leaves.items()} for leaves in per_rank]
    lines = common_differences(digests)  # paths and ranks, no values: the same at each save of a run
    if warned is not None:
        if tuple(lines) in warned:
            return
        warned.add(tuple(lines))
    differences = rank_differences(per_rank, comm.rank)
    if differences != ("[]", "[]", "[]"):  # each differing rank's own line, Megatron-Core's to the letter
        rank = comm.global_rank(comm.rank) if comm.distributed else 0
        logger.warning("Rank %d common state dict differs from rank 0 common state dict. Keys only on rank 0: %s, "
                       "Keys only on %d: %s, Mismatched keys: %s", rank, differences[0], rank, *differences[1:])
    if comm.rank == 0:  # rank 0's line says where and what is lost
        logger.warning(
            "save to %s: the common (non-sharded) state differs between ranks; only rank 0's copy is saved, "
            "so other ranks' values are lost (make rank-dependent state a ShardedObject, or identical on all "
            "ranks)%s:\n  %s", target, "" if warned is None else " (said once per run for these differences)",
            "\n  ".join(lines),
        )
