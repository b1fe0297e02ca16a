"""The request of one asynchronous save (:class:`AsyncSaveRequest`): its background thread, which
writes (and, with ``commit_in_background``, commits) while the caller trains, and its ``finalize``,
which commits exactly once on every rank (:mod:`.async_save` makes it)."""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import replace
from typing import Optional, Union

from ..comm import Comm
from ..core.errors import CheckpointingError, SaveFailedError
from ..storage.store import CheckpointStore
from . import async_pending
from .background_snapshot import BackgroundSnapshot
from .heap import release_free_heap
from .priority import yielding_cpu
from .save import LocalWrite, PreparedSave, finalize_save, write_local

logger = logging.getLogger(__name__)

WriteResult = Union[LocalWrite, BaseException]


class AsyncSaveRequest:
    """A save whose writes run in the background. Call :meth:`finalize` on every rank to commit.
    Returned by ``save(..., async_save=True)`` and :meth:`AsyncSaver.save`, never built by the caller.

    ``done()`` says, without blocking and without communication, whether this rank's writes have
    finished; ``finalize()`` blocks until they have, then (collectively) commits the checkpoint if
    every rank succeeded, or raises :class:`SaveFailedError` on every rank if any failed. The
    checkpoint does not exist at its target until ``finalize`` returns (with ``reserved``, an empty
    directory holds its name meanwhile: :mod:`.async_pending`). A request of a group of one (no
    collective in its commit) that is never finalized is committed when the process exits.

    With ``commits_in_background`` (``AsyncSaver(commit_in_background=True)``) the background thread
    also commits, as soon as its writes are done, over a process group of the saver's own (the
    training's collectives never wait for it): ``done()`` then says the save is committed (or failed),
    and ``finalize()`` only waits for the thread and raises its error, with no communication.
    """

    def __init__(self, prep: PreparedSave, blocking_s: float, staged_bytes: int,
                 failure: Optional[BaseException] = None, snapshot_s: float = 0.0, reserved: bool = False,
                 written: Optional[LocalWrite] = None, waves: int = 1, nice: int = 0,
                 commit_comm: Optional[Comm] = None, snapshot: Optional[BackgroundSnapshot] = None,
                 release_heap: bool = False) -> None:
        self.checkpoint_dir = prep.target
        self.collective = prep.comm.distributed  # its commit needs every rank: never finalized at exit
        self._commit_comm = commit_comm  # the background thread commits over this group; None: finalize commits
        self.commits_in_background = commit_comm is not None
        self._reserved = reserved  # this process holds the target's name with an empty directory
        self.blocking_s = blocking_s  # the caller's wait in save(): planning + snapshot
        self.snapshot_s = snapshot_s  # of which copying into the staging buffers
        self.blocking_cpu_s = 0.0  # the caller's CPU-seconds in save() (its thread's)
        self.snapshot_cpu_s = 0.0  # of which the snapshot's
        self.staged_bytes = staged_bytes
        self.waves = waves  # write calls: those made before save returned (a staging budget), then the background one
        self._written = written  # what was written before save returned (waves under a staging budget)
        self.plan_reused = prep.plan_reused  # the saver's cached plan was reused (no metadata exchange)
        self._prep = prep
        self._result: Optional[WriteResult] = failure
        self._finalized = False
        self._finalizing = threading.RLock()  # one finalize commits (re-entrant: a signal handler may finalize)
        self._pid = os.getpid()  # a forked child's copy is not its to commit or remove
        self._error: Optional[BaseException] = None
        self._thread: Optional[threading.Thread] = None
        # Set as the thread's work ends: not is_alive / join, after which an interrupted join says the running
        # thread stopped (CPython 3.11's bpo-45274 handling): the next save reused the pool it wrote from.
        self._ended = threading.Event()
        self._polls = 0  # calls of poll(): the same count on every rank
        self._nice = nice
        self._snapshot = snapshot  # the shards the background thread copies before writing (background_snapshot)
        self._release_heap = release_heap  # under a memory budget: freed heap back to the OS when done (.heap)
        if failure is None or commit_comm is not None:  # a background commit reports the failure collectively
            self._thread = threading.Thread(target=self._write, name="distckpt-async-save", daemon=False)
            self._thread.start()
        async_pending.track(self)

    def _write(self) -> None:
        try:
            if self._snapshot is not None and self._result is None:
                try:  # at the caller's priority, not nice: the caller waits for it before its next update
                    self._snapshot.take()
                except BaseException as e:  # reported on every rank by the commit
                    self._result = e
            with yielding_cpu(self._nice):
                self._write_and_commit()
            if self._release_heap:
                release_free_heap()
        finally:
            if self._snapshot is not None:
                self._snapshot.release()  # wait_snapshot() never outlives the thread
            self._ended.set()

    def _write_and_commit(self) -> None:
        if self._result is None:  # else the snapshot failed: nothing to write, the commit says so everywhere
            try:
                result = write_local(self._prep)
                before = self._written
                self._result = result if before is None else LocalWrite(result.nbytes + before.nbytes,
                                                                        result.seconds + before.seconds)
            except BaseException as e:  # reported on every rank by the commit
                self._result = e
        if self._commit_comm is not None:
            self._commit(replace(self._prep, comm=self._commit_comm))

    def _commit(self, prep: PreparedSave) -> None:
        """Agree on every rank's writes and commit (collective over ``prep.comm``); keeps the error."""
        result = self._result if self._result is not None else SaveFailedError(
            f"save to {self.checkpoint_dir}: the background write ended without a result")
        try:
            finalize_save(prep, result)  # the commit replaces the placeholder (an empty directory) in one swap
        except BaseException as e:
            self._error = e
        finally:
            if self._reserved:  # a failed save's placeholder goes (only an empty directory is ever removed)
                async_pending.release_target(self.checkpoint_dir, self._prep.store)
            self._prep = replace(self._prep, tensors=[], objects=[], common=None)  # drop references to buffers

    @property
    def store(self) -> CheckpointStore:
        """The store this save writes through (the caller's, or a copy of it with the saver's options)."""
        return self._prep.store

    @property
    def background_snapshot_s(self) -> float:
        """Seconds the background thread spent copying what ``background_snapshot`` left to it."""
        return 0.0 if self._snapshot is None else self._snapshot.seconds

    def snapshot_done(self) -> bool:
        """Whether the caller may change the saved tensors (non-blocking, local): always, unless
        ``background_snapshot`` left some of the copy to the background thread and it is not done."""
        return self._snapshot is None or self._snapshot.done() or not self._running()

    def wait_snapshot(self) -> None:
        """Block until the caller may change the saved tensors (local): the background thread has
        copied what ``background_snapshot`` left to it (or the save failed first). A change before
        then fails the save where torch's version counters see it (:mod:`.background_snapshot`)."""
        if self._snapshot is not None and self._running():
            self._snapshot.wait()

    def _running(self) -> bool:
        return self._thread is not None and not self._ended.is_set()

    def done(self) -> bool:
        """Whether this rank's background writes (with ``commits_in_background``: and commit) have ended (local)."""
        return not self._running()

    def failed(self) -> bool:
        """Whether the background commit (``commits_in_background``) has ended in an error (local, raises nothing)."""
        return self.done() and self._error is not None

    def wait(self) -> None:
        """Block until this rank's background writes have finished (local, no commit)."""
        if self._thread is not None:
            self._ended.wait()

    def all_done(self) -> bool:
        """Collective: whether every rank's writes have finished (to finalize without blocking)."""
        return all(self._prep.comm.all_gather_object(self.done()))

    def poll(self) -> bool:
        """Collective, for a caller asking at every training step: :meth:`all_done`, but the ranks are
        asked only on the 1st, 2nd, 4th, 8th and then every 16th call (the others return False without
        communicating; every rank must call it equally often). Each ask is a round trip waiting for the
        slowest rank; at every step of a fast loop they cost more than the save (docs/benchmarks.md).
        A finished save is committed at most twice the calls its writes took, or 15 more, later."""
        self._polls += 1
        n = self._polls
        return (n & (n - 1) == 0 or n % 16 == 0) and self.all_done()

    @property
    def finalized(self) -> bool:
        return self._finalized

    def finalize(self) -> None:
        """Collective: wait for the writes, then commit (or raise SaveFailedError everywhere).
        With ``commits_in_background``: wait for the background commit and raise its error (local).
        Calling it again, or meanwhile on another thread (which waits for the first call), returns or
        re-raises the same error without communicating: a save is committed once."""
        if self._pid != os.getpid():  # checked first: the parent may have held the lock as it forked
            raise CheckpointingError(f"save to {self.checkpoint_dir} was started by process {self._pid}: its fork "
                                     f"{os.getpid()} cannot finalize it (its files are the parent's); nothing was done")
        if not self._finalized:
            self.wait()  # interrupted (KeyboardInterrupt): not finalized, the next call waits again
        with self._finalizing:  # held only to commit: a call on another thread meanwhile waits, then finds it done
            if not self._finalized:
                self._finalized = True
                async_pending.untrack(self)
                if self._commit_comm is None:  # on this thread: no name check of this process runs before the commit
                    self._commit(self._prep)
                if self._error is None:
                    logger.info("async save %s committed (caller blocked %.3fs)", self.checkpoint_dir, self.blocking_s)
        if self._error is not None:
            raise self._error
