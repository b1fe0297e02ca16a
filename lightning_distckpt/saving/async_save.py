"""Asynchronous save: the caller is blocked only while the state is planned (a metadata exchange)
and snapshotted into host staging buffers (under a staging budget, also while what does not fit
is written: :mod:`.async_staging`); the writes run in a background thread; ``finalize`` (on the
caller's thread, collective) waits for them, agrees on success over all ranks and only then
commits, or, with ``commit_in_background``, the background thread agrees and commits itself
over a process group of the saver's own.

The background thread makes no collective call on the caller's group, so it never races the
training's collectives. Staging buffers (views of one host pool, pinned when the state is on an
accelerator: device-to-host copies are then asynchronous DMA) are kept by the :class:`AsyncSaver`
and reused by the next save of the same layout. The thread runs at a lower scheduling priority
(``nice``): the writes take the CPU the training leaves."""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import replace
from typing import Any, Dict, Optional, Tuple, Union

import torch
import torch.distributed as dist

from ..comm import Comm, get_comm
from ..core.arguments import require_int_in
from ..core.errors import CheckpointingError, SaveFailedError
from ..storage.store import CheckpointStore
from ..storage.stores import SaveTarget, save_target
from ..storage.tensorstore_io import StorageOptions
from . import async_pending
from .async_staging import (WRITER_BYTES, BufferKey, StagingPlan, StagingPool, copy_in, describe, plan_staging,
                            pool_share, write_before_return)
from .background_snapshot import BackgroundSnapshot, Selector, split_snapshot
from .heap import release_free_heap
from .priority import yielding_cpu
from .save import LocalWrite, PreparedSave, SavePlanCache, finalize_save, prepare_save, write_local
from .stats import format_bytes

logger = logging.getLogger(__name__)

WriteResult = Union[LocalWrite, BaseException]


class AsyncSaveRequest:
    """A save whose writes run in the background. Call :meth:`finalize` on every rank to commit.

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
                async_pending.release_target(self.checkpoint_dir)
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


class AsyncSaver:
    """Saves asynchronously, reusing its host staging pool from one save to the next.

    ``save`` first finalizes the previous request if the caller has not (so at most one save is
    in flight and its buffers are free to reuse). It also keeps the validated save plan
    (:class:`SavePlanCache`, ``plan_cache``): when no rank's shard metadata changed since the
    previous save, the metadata all-gather, validation and planning are skipped (one tiny
    round trip instead), which is most of the caller's blocking time besides the snapshot.
    Keep one AsyncSaver per training run.

    Args:
        pin_memory: stage accelerator tensors in pinned host memory (default: when available).
        reserve_targets: while a save is in flight, hold its (local) target's name with an empty
            directory, so that whoever picks free names by asking what exists (Lightning's
            ``ModelCheckpoint``) does not pick it again (:mod:`.async_pending`).
        max_staging_bytes: the most host memory (bytes, per rank) a save may add; None: no limit,
            the rank's state staged whole. ``writer_bytes`` of it are the writer's buffers', the
            rest the snapshot's; a larger state goes in waves (:mod:`.async_staging`): the largest
            shards that fit are snapshotted and written in the background, the rest before ``save``
            returns (the caller may change its tensors then: CPU shards from their own memory,
            accelerator shards through the pool a wave at a time), and an accelerator shard larger
            than the snapshot's share raises :class:`ArgumentError`. Less memory, a longer wait in
            ``save``. The save's thread gives its freed heap back when done (:mod:`.heap`).
        writer_bytes: of ``max_staging_bytes``, the bytes left to the writer's buffers and threads,
            which any save takes, synchronous too (6 to 17 MiB measured on a 2-vCPU VM)
            (:data:`~.async_staging.WRITER_BYTES`, 32 MiB, by default; 0: all to the snapshot).
        nice: the background writes' scheduling priority (Linux ``nice`` of the writing thread, 0 to
            19; 0 keeps the caller's): they yield the CPU to the training where it uses every core.
        io_concurrency: at most this many tensorstore threads copy and write in the background
            (``StorageOptions.io_concurrency`` caps it too); None: the storage options'.
        commit_in_background: the background thread also commits (:class:`AsyncSaveRequest`,
            ``commits_in_background``), over a gloo group the saver makes at its first save over the
            whole world (every rank calls ``save``, so every rank makes it); a save over a subgroup
            commits at ``finalize`` as without it. The training thread then neither asks the other
            ranks whether the writes are done nor waits for the commit's agreement and fsyncs. With
            ``reserve_targets`` the commit swaps the checkpoint in over the placeholder, so the name
            is never free while the save is in flight.
    """

    def __init__(self, pin_memory: Optional[bool] = None, reserve_targets: bool = False,
                 max_staging_bytes: Optional[int] = None, nice: int = 10,
                 io_concurrency: Optional[int] = None, commit_in_background: bool = False,
                 writer_bytes: int = WRITER_BYTES) -> None:
        require_int_in("max_staging_bytes", max_staging_bytes, 0, none_ok=True)
        require_int_in("writer_bytes", writer_bytes, 0)
        require_int_in("nice", nice, 0, 19)
        require_int_in("io_concurrency", io_concurrency, 1, none_ok=True)
        self.pin_memory = pin_memory
        self.reserve_targets = reserve_targets
        self.max_staging_bytes = max_staging_bytes
        self.writer_bytes = writer_bytes
        self.nice = nice
        self.io_concurrency = io_concurrency
        self.commit_in_background = commit_in_background
        # (the world group it was made in, the group): made by the first save over each new world
        self._commit_group: Optional[Tuple[Any, dist.ProcessGroup]] = None
        self._pool = StagingPool(pin_memory)
        self._pending: Optional[AsyncSaveRequest] = None
        self.plan_cache = SavePlanCache()

    def __getstate__(self) -> Dict[str, Any]:
        """A copy (pickle, ``deepcopy``) starts afresh: the save in flight (a thread, its process
        group), the staging pool and the cached plan stay with this saver."""
        return {name: getattr(self, name) for name in ("pin_memory", "reserve_targets", "max_staging_bytes", "nice",
                                                       "io_concurrency", "commit_in_background", "writer_bytes")}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__init__(**state)  # type: ignore[misc]

    def staging_buffers(self) -> Dict[BufferKey, torch.Tensor]:
        """The last staged wave's buffers by (key, stored index, shape, dtype) (views of the pool)."""
        return dict(self._pool.views)

    @property
    def staging_bytes(self) -> int:
        """Host memory held for staging now (the pool)."""
        return self._pool.nbytes

    @property
    def peak_staging_bytes(self) -> int:
        """The most host memory staging has held (never above ``max_staging_bytes - writer_bytes``
        when a budget is set)."""
        return self._pool.peak_bytes

    @property
    def pending(self) -> Optional[AsyncSaveRequest]:
        p = self._pending  # (in a forked child's copy of the saver: none, its parent's is the parent's)
        return p if p is not None and not p.finalized and p._pid == os.getpid() else None

    def finalize(self) -> None:
        """Finalize the pending request, if any (collective). Interrupted while it waits (KeyboardInterrupt),
        the request stays pending: the next ``save`` waits for it before reusing the pool its thread reads."""
        pending = self.pending
        if pending is not None:
            pending.finalize()  # (raising, it is kept: ``pending`` leaves out a finalized one)
            self._pending = None

    def save(
        self,
        sharded_state_dict: Dict[str, Any],
        checkpoint_dir: SaveTarget,
        *,
        process_group: Optional[dist.ProcessGroup] = None,
        validate_access_integrity: bool = True,
        balance_writes: bool = True,
        storage: Optional[StorageOptions] = None,
        comm: Optional[Comm] = None,
        background_snapshot: Selector = False,
    ) -> AsyncSaveRequest:
        """Start saving (collective); returns once the state is snapshotted (and, under a staging
        budget smaller than the state, the rest written). Same arguments as
        :func:`lightning_distckpt.save`. Raises the previous save's error if it failed.

        ``comm`` replaces ``process_group`` where the caller has its own: ``Comm(None, 0, 1)`` saves
        from this process alone, entering no collective (e.g. a rank-0-only Lightning save).

        ``background_snapshot``: ``True`` (every shard), or a test of a shard's source tensor (e.g.
        "is a parameter or optimizer state"): those shards of the staged wave are copied by the
        background thread, not before ``save`` returns, and the caller must not change them until
        the request's ``wait_snapshot()`` returns (:mod:`.background_snapshot`)."""
        self.finalize()
        t0, c0 = time.perf_counter(), time.thread_time()
        comm = comm if comm is not None else get_comm(process_group)
        target, storage = save_target(checkpoint_dir, storage)
        options = storage or StorageOptions()
        if self.io_concurrency is not None and self.io_concurrency < options.io_concurrency:
            options = replace(options, io_concurrency=self.io_concurrency)  # a writer's choice: not in the plan
        prep = prepare_save(
            sharded_state_dict, target, comm,
            validate_access_integrity=validate_access_integrity, balance_writes=balance_writes,
            options=options, plan_cache=self.plan_cache,
        )
        failure: Optional[BaseException] = None
        written: Optional[LocalWrite] = None
        snapshot: Optional[BackgroundSnapshot] = None
        plan = StagingPlan([], [], prep.tensors)
        t1, c1 = time.perf_counter(), time.thread_time()
        try:  # any failure (out of host memory, a full disk) is raised on every rank by finalize, not here
            plan = plan_staging(prep.tensors, self.max_staging_bytes, self.writer_bytes)
            self._pool.prepare(plan)
            written = write_before_return(prep, plan, self._pool)
            placed = self._pool.place(plan.staged)
            now, later = split_snapshot(placed, background_snapshot)
            copy_in(now)
            snapshot = BackgroundSnapshot(later, prep.target) if later else None
            prep = replace(prep, tensors=[w for w, _ in placed])
        except Exception as e:
            failure = e
        t2, c2 = time.perf_counter(), time.thread_time()
        reserved = (self.reserve_targets and failure is None and comm.rank == 0
                    and async_pending.reserve_target(prep.target))
        staged_bytes = sum(w.data.numel() * w.data.element_size() for w in plan.staged)
        self._pending = AsyncSaveRequest(prep, t2 - t0, staged_bytes, failure, snapshot_s=t2 - t1, reserved=reserved,
                                         written=written, waves=plan.waves, nice=self.nice,
                                         commit_comm=self._background_comm(comm), snapshot=snapshot,
                                         release_heap=self.max_staging_bytes is not None)
        self._pending.blocking_cpu_s, self._pending.snapshot_cpu_s = c2 - c0, c2 - c1
        logger.info("async save %s started: %s in %.3fs%s, caller blocked %.3fs (plan %s)", prep.target,
                    describe(plan, self.max_staging_bytes), t2 - t1,
                    "" if snapshot is None else f" ({format_bytes(snapshot.nbytes)} left to the background copy)",
                    t2 - t0, "reused" if prep.plan_reused else "made")
        return self._pending

    def make_commit_group(self, comm: Comm) -> None:
        """Collective over ``comm`` (every rank): make now the gloo group the first save would
        make for its background commit, so that save does not wait for the group's rendezvous."""
        self._background_comm(comm)

    def reserve_staging(self, nbytes: int, on_accelerator: bool) -> None:
        """Allocate the staging pool for an expected ``nbytes`` largest wave (capped at the snapshot's
        share of ``max_staging_bytes``) and fault its pages in on a thread of its own, ahead of the
        first save (see :meth:`StagingPool.reserve`); a save of another size reallocates as before."""
        share = pool_share(self.max_staging_bytes, self.writer_bytes)
        nbytes = nbytes if share is None else min(nbytes, share)
        self._pool.reserve(nbytes, on_accelerator and (self.pin_memory if self.pin_memory is not None else True))

    def _background_comm(self, comm: Comm) -> Optional[Comm]:
        """Where the background thread commits: the group of one itself; for the whole world (in
        its rank order), a gloo group of this saver's own, made now (collective: every rank is in
        this save); None (the caller's ``finalize`` commits) otherwise or when not asked to."""
        if not self.commit_in_background:
            return None
        if not comm.distributed:
            return comm
        world = list(range(dist.get_world_size()))
        if comm.group is not None and dist.get_process_group_ranks(comm.group) != world:
            return None
        if self._commit_group is None or self._commit_group[0] is not dist.group.WORLD:  # made anew with a new world
            self._commit_group = (dist.group.WORLD, dist.new_group(world, backend="gloo"))
        return Comm(self._commit_group[1], comm.rank, comm.size)
