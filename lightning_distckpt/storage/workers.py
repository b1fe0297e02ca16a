"""Helper threads kept between saves (fsyncs, blobs, O_DIRECT chunk writes).

Starting threads for every save costs more than the work of a small one, so a few are kept. They
follow the convention of Lightning's own background threads, which its test suites enforce (a test
that leaves a thread behind fails, unless the thread is a daemon with a ``stop()``): each is a
daemon with :meth:`_Worker.stop`, which stops every thread of its pool and returns once they have
ended; the pool starts new ones at its next use. Daemon threads are safe here: the thread that
waits for their work (the caller, or an async save's non-daemon thread) keeps the interpreter
alive until it is done. A forked child starts threads of its own (the parent's do not exist
there). At interpreter shutdown :meth:`KeptWorkers.submit` returns None and the caller does the
work itself.
"""

from __future__ import annotations

import os
import queue
import sys
import threading
from concurrent.futures import Future
from typing import Any, Callable, List, Optional

_STOP = object()


class _Worker(threading.Thread):
    def __init__(self, pool: "KeptWorkers", name: str) -> None:
        super().__init__(name=name, daemon=True)
        self._pool = pool

    def run(self) -> None:
        tasks = self._pool._tasks
        while True:
            item = tasks.get()
            if item is _STOP:
                return
            future, fn, args = item
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as e:  # the caller's result() raises it
                    future.set_exception(e)
            # Let go of the task before waiting for the next: kept, its closure (a save's whole plan, the
            # tensors it wrote) lived until the next task came, and every collection scanned it meanwhile.
            del item, future, fn, args

    def stop(self) -> None:
        """Stop every thread of this pool (after the work already queued) and wait for them."""
        self._pool.stop()


class KeptWorkers:
    """Up to ``size`` daemon threads named ``name_<i>``, started on first use and kept."""

    def __init__(self, name: str, size: int) -> None:
        self.name, self.size = name, size
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._tasks: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
        self._threads: List[_Worker] = []
        self._started = 0

    def submit(self, fn: Callable[..., Any], *args: Any) -> "Optional[Future[Any]]":
        """``fn(*args)`` on one of the threads; None at interpreter shutdown (run it yourself)."""
        if sys.is_finalizing():
            return None
        future: "Future[Any]" = Future()
        with self._lock:
            if self._pid != os.getpid():  # a forked child: the parent's threads and queue are not ours
                self._pid, self._tasks, self._threads = os.getpid(), queue.SimpleQueue(), []
            self._threads = [t for t in self._threads if t.is_alive()]
            if len(self._threads) < self.size:
                worker = _Worker(self, f"{self.name}_{self._started}")
                self._started += 1
                try:
                    worker.start()
                except RuntimeError:  # "can't create new thread at interpreter shutdown"
                    return None
                self._threads.append(worker)
            self._tasks.put((future, fn, args))
        return future

    def stop(self) -> None:
        """End every thread (each finishes the work queued before) and wait for them."""
        with self._lock:
            threads, self._threads = self._threads, []
            for _ in threads:
                self._tasks.put(_STOP)
        for t in threads:
            if t is not threading.current_thread():
                t.join()
