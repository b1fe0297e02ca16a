"""Freed heap given back to the operating system after a save under a host-memory budget.

glibc keeps memory that a save's threads allocated and freed (tensorstore's buffers, gloo's, the
packs') in per-thread arenas for reuse, and that retention grows from save to save: on a 2-vCPU VM
it added 15 to 40 MiB per rank beyond a budget over five local-tier saves
(``benchmarks/bench_tier_memory.py``). ``malloc_trim`` hands it back; it runs on the save's own
thread once its writes are done, and took 1 to 20 ms there. Elsewhere (musl, macOS) it does nothing.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import time
from typing import Any, Optional

logger = logging.getLogger(__name__)


@functools.lru_cache(maxsize=None)
def _malloc_trim() -> Optional[Any]:
    """glibc's ``malloc_trim``, or None where the C library has none."""
    try:
        trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    except OSError:  # no C library to open (not expected on Linux)
        return None
    if trim is not None:
        trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def release_free_heap() -> bool:
    """Return the allocator's free memory to the OS where the C library can (glibc's
    ``malloc_trim(0)``); whether it could."""
    trim = _malloc_trim()
    if trim is None:
        return False
    t0 = time.perf_counter()
    released = trim(0)
    logger.debug("freed heap handed back to the OS (malloc_trim: %s) in %.4fs", "some" if released else "none",
                 time.perf_counter() - t0)
    return True
