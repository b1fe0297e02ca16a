"""Scheduling priority of background checkpoint work: the threads of an async save (and the
tensorstore workers they use) run below the training's priority, so that where the training uses
every core the writes take the CPU time it leaves rather than slowing its steps (Linux: per thread)."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from typing import Iterator

logger = logging.getLogger(__name__)

IO_THREAD_NAME = "ts_pool_worker"  # the (Linux) name of tensorstore's worker threads
_RENICE_EVERY_S = 0.1  # how often a background save looks for tensorstore workers started meanwhile


@contextlib.contextmanager
def yielding_cpu(nice: int) -> Iterator[None]:
    """Run the block with this thread and tensorstore's worker threads at scheduling priority
    ``nice`` (Linux: per thread), so that where the training uses every core the background writes
    take the CPU time it leaves rather than slowing its steps. Nothing where the OS does not allow it.

    The workers do most of a save's CPU work (the copy into the page cache, the fsyncs). They are
    shared by the process and started by tensorstore's own thread with its priority: when a load
    or a synchronous save on the training thread used tensorstore first, they and every worker
    started later would run at the training's priority. So they are lowered at the start, and
    workers started during the save are lowered as they appear (an idle worker exits after some
    seconds, so a save minutes later starts new ones). Once lowered they stay so (an unprivileged
    process cannot raise a priority back): later loads on them only yield to busy cores."""
    if nice <= 0 or not hasattr(os, "setpriority"):
        yield
        return
    lower_thread(threading.get_native_id(), nice)
    _lower_io_threads(nice)
    done = threading.Event()

    def watch() -> None:
        while not done.wait(_RENICE_EVERY_S):
            _lower_io_threads(nice)

    watcher = threading.Thread(target=watch, name="distckpt-renice", daemon=True)  # inherits ``nice``
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join()


def lower_thread(tid: int, nice: int) -> None:
    """Lower the thread ``tid`` of this process to priority ``nice`` (never raise it)."""
    try:
        if os.getpriority(os.PRIO_PROCESS, tid) < nice:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
    except OSError as e:  # gone meanwhile, or not allowed: it keeps its priority
        logger.debug("thread %d keeps its priority: %s", tid, e)


def _lower_io_threads(nice: int) -> None:
    """Lower tensorstore's worker threads of this process to ``nice`` (Linux ``/proc``; else nothing)."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                if f.read().strip() != IO_THREAD_NAME:
                    continue
        except OSError:  # exited meanwhile
            continue
        lower_thread(int(task), nice)
