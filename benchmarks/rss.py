"""Peak resident memory of this process around one operation (Linux ``/proc``; None elsewhere)."""

from __future__ import annotations

from typing import Optional


def status_kib(field: str) -> Optional[int]:
    """A ``/proc/self/status`` field in KiB (``VmRSS``, ``VmHWM``), None when unavailable."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def reset_peak() -> Optional[int]:
    """Reset this process's peak RSS (VmHWM; ``clear_refs`` 5) and return the RSS now, KiB."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return None
    return status_kib("VmRSS")


def peak_increase_mib(rss_before_kib: Optional[int]) -> Optional[float]:
    """Peak RSS since :func:`reset_peak` above the RSS it returned, MiB."""
    hwm = status_kib("VmHWM")
    return None if rss_before_kib is None or hwm is None else (hwm - rss_before_kib) / 1024
