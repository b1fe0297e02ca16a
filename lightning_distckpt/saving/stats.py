"""Throughput logging for saves and loads: one INFO line per save or load on rank 0 (bytes,
seconds, rate, in a unit that fits: ``1.3 MB in 0.052 s (25.4 MB/s)``); each rank's own line, and
per-stage times where the caller has them, at DEBUG.

The records go to the ``lightning_distckpt`` logger, which is quiet in plain Python (a
``NullHandler``, as a library's should be: ``logging.basicConfig(level=logging.INFO)`` shows
them) and shown at INFO under the Lightning Trainer or Fabric (:mod:`lightning_distckpt.logs`).
"""

from __future__ import annotations

import logging
from typing import Callable, Optional, Sequence, Tuple

logger = logging.getLogger(__name__)

_UNITS = ("B", "KB", "MB", "GB", "TB", "PB")


def format_bytes(n: float) -> str:
    """``n`` bytes in the decimal unit that fits: ``512 B``, ``1.3 MB``, ``268.4 GB``."""
    n = float(n)
    for unit in _UNITS:
        if abs(n) < 1000 or unit == _UNITS[-1]:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def format_rate(nbytes: int, seconds: float) -> str:
    """``nbytes`` over ``seconds`` as a rate in the unit that fits: ``25.4 MB/s``, ``3.1 GB/s``."""
    return f"{format_bytes(nbytes / max(seconds, 1e-9))}/s"


def log_throughput(op: str, where: str, rank: int, per_rank: Sequence[Tuple[int, float]], seconds: float,
                   detail: Optional[Callable[[], str]] = None) -> None:
    """On rank 0, one INFO line: the total over ranks end to end; on every rank, its own I/O at
    DEBUG (``per_rank`` = (bytes, io seconds) of each rank), and ``detail()`` (per-stage times,
    built only when DEBUG is on) on rank 0."""
    nbytes, io_s = per_rank[rank]
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug("%s %s rank %d: %s in %.3f s of I/O (%s)", op, where, rank, format_bytes(nbytes), io_s,
                     format_rate(nbytes, io_s))
        if rank == 0 and detail is not None:
            logger.debug("%s %s per rank:\n%s", op, where, detail())
    if rank == 0:
        total = sum(b for b, _ in per_rank)
        ranks = f" on {len(per_rank)} ranks" if len(per_rank) > 1 else ""
        logger.info("%s %s: %s%s in %.3f s (%s)", op, where, format_bytes(total), ranks, seconds,
                    format_rate(total, seconds))
