"""Per-rank accounts of a load (seconds and bytes per stage) and their table."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence


@dataclass
class LoadStats:
    """One rank's account of a load (seconds and bytes).

    read_s: time spent reading from storage (in the reader thread when pipelined);
    read_wait_s: time the exchange waited for a read to finish (reads not hidden by overlap);
    copy_s: host/device copies (into comm buffers, out of them, into the destinations);
    comm_s: time waiting for broadcasts / sends / receives to complete;
    total_s: the whole load on this rank, metadata exchange and common state included.
    peak_inflight_bytes: the most bytes of ops admitted and not yet finished at once;
    peak_extra_bytes: the most bytes of buffers the loader allocated itself at once (reads that
    land in the destinations and receives into them allocate nothing).
    """

    rank: int = 0
    read_s: float = 0.0
    read_wait_s: float = 0.0
    copy_s: float = 0.0
    comm_s: float = 0.0
    total_s: float = 0.0
    bytes_read: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    ops: int = 0
    peak_inflight_bytes: int = 0
    peak_extra_bytes: int = 0
    inflight_limit: Optional[int] = None


def format_load_times(stats: Sequence[LoadStats]) -> str:
    """A per-rank table of stage times and bytes."""
    head = f"{'rank':>4} {'read_s':>8} {'wait_s':>8} {'copy_s':>8} {'comm_s':>8} {'total_s':>8} " \
           f"{'read_MB':>9} {'sent_MB':>9} {'recv_MB':>9} {'inflight_MB':>11} {'extra_MB':>8}"
    rows = [head]
    for s in stats:
        rows.append(
            f"{s.rank:>4} {s.read_s:>8.3f} {s.read_wait_s:>8.3f} {s.copy_s:>8.3f} {s.comm_s:>8.3f} {s.total_s:>8.3f} "
            f"{s.bytes_read / 1e6:>9.2f} {s.bytes_sent / 1e6:>9.2f} {s.bytes_received / 1e6:>9.2f} "
            f"{s.peak_inflight_bytes / 1e6:>11.2f} {s.peak_extra_bytes / 1e6:>8.2f}"
        )
    return "\n".join(rows)
