"""Python's cyclic garbage collector paused around checkpoint bookkeeping."""

from __future__ import annotations

import contextlib
import gc
from typing import Iterator


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """The cyclic garbage collector off for the block, back as it was after (on failure too).

    Planning a save and planning a load create hundreds of thousands of small records (indexes,
    plans, requests), none in a reference cycle. Each 700 allocations start a young-generation
    pass, and every hundredth pass scans every object of the process (a quarter million once torch
    and Lightning are imported): half the coordinator's planning time at 16,384 simulated ranks, and
    0.1-0.35 s of a 0.5 GiB cold load on 2 vCPUs (docs/benchmarks.md, "Cold load profile").
    Reference counting still frees everything; the collector's next run sees the rest.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
