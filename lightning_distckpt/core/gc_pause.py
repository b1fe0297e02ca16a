"""Python's cyclic garbage collector paused around checkpoint bookkeeping, per call and safely
beside other threads."""

from __future__ import annotations

import contextlib
import gc
import threading
from typing import Iterator

_lock = threading.Lock()
_holders = 0  # pauses open now, in any thread: the collector comes back when the last one ends
_resume = False  # whether the collector was enabled when the first of them began


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """The cyclic garbage collector off for the block, back as it was after (on failure too).

    Planning a save and planning a load create hundreds of thousands of small records (indexes,
    plans, requests), none in a reference cycle. Each 700 allocations start a young-generation
    pass, and every hundredth pass scans every object of the process (a quarter million once torch
    and Lightning are imported): half the coordinator's planning time at 16,384 simulated ranks, and
    0.1-0.35 s of a 0.5 GiB cold load on 2 vCPUs (docs/benchmarks.md, "Cold load profile").
    Reference counting still frees everything; the collector's next run sees the rest.

    The collector is one switch for the whole process, so pauses are counted (under a lock):
    overlapping pauses keep it off until the last one ends, and only then is it restored to what it
    was before the first (a pause never re-enables a collector its caller turned off, and never
    turns it back on under another pause). Only the main thread pauses it: a background thread (an
    :class:`~lightning_distckpt.saving.async_save.AsyncSaver` writing while training goes on) runs
    its block with the collector as the main thread left it, so a long background step never keeps
    it off for the training loop, nor turns it back on under the main thread's pause.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    global _holders, _resume
    with _lock:
        if _holders == 0:
            _resume = gc.isenabled()
            gc.disable()
        _holders += 1
    try:
        yield
    finally:
        with _lock:
            _holders -= 1
            if _holders == 0 and _resume:
                gc.enable()
