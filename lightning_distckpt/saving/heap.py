"""Freed heap given back to the operating system after a save under a host-memory budget.

glibc keeps memory that a save's threads allocated and freed (tensorstore's buffers, gloo's, the
packs') in per-thread arenas for reuse, and that retention grows from save to save: on a 2-vCPU VM
it added 15 to 40 MiB per rank beyond a budget over five local-tier saves
(``benchmarks/bench_tier_memory.py``). ``malloc_trim`` hands it back; it runs on the save's own
thread once its writes are done, and took 1 to 20 ms there. Elsewhere (musl, macOS) it does nothing.
"""

from __future__ import annotations

import ctypes
import logging
import time
from typing import Any, Optional

logger = logging.getLogger(__name__)

_trim: Optional[Any] = None
_looked_up = False


def release_free_heap() -> bool:
    """Return the allocator's free memory to the OS where the C library can (glibc's
    ``malloc_trim(0)``); whether it could."""
    global _trim, _looked_up
    if not _looked_up:
        _looked_up = True
        try:
            _trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
        except OSError:  # no C library to open (not expected on Linux)
            _trim = None
        if _trim is not None:
            _trim.argtypes, _trim.restype = [ctypes.c_size_t], ctypes.c_int
    if _trim is None:
        return False
    t0 = time.perf_counter()
    released = _trim(0)
    logger.debug("freed heap handed back to the OS (malloc_trim: %s) in %.4fs", "some" if released else "none",
                 time.perf_counter() - t0)
    return True
