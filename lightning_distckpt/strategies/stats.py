"""Throughput logging for saves and loads: bytes, seconds and GB/s per rank and in total."""

from __future__ import annotations

import logging
from typing import Sequence, Tuple

logger = logging.getLogger(__name__)


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / max(seconds, 1e-9) / 1e9


def log_throughput(op: str, where: str, rank: int, per_rank: Sequence[Tuple[int, float]], seconds: float) -> None:
    """Log this rank's I/O and, on rank 0, the total over ranks (``per_rank`` = (bytes, io seconds))."""
    nbytes, io_s = per_rank[rank]
    logger.info("%s %s rank %d: %d bytes in %.3fs (%.2f GB/s)", op, where, rank, nbytes, io_s, gbps(nbytes, io_s))
    if rank == 0:
        total = sum(b for b, _ in per_rank)
        logger.info(
            "%s %s: %d bytes on %d ranks in %.3fs end to end (%.2f GB/s aggregate)",
            op, where, total, len(per_rank), seconds, gbps(total, seconds),
        )
