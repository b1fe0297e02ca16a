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
import time
from dataclasses import replace
from typing import Any, Dict, Optional, Tuple

import torch
import torch.distributed as dist

from ..comm import Comm, get_comm, new_gloo_group
from ..core.arguments import require_int_in
from ..storage.stores import SaveTarget, save_target
from ..storage.tensorstore_io import StorageOptions
from . import async_pending
from .async_staging import (WRITER_BYTES, BufferKey, StagingPlan, StagingPool, copy_in, describe, plan_staging,
                            pool_share, write_before_return)
from .background_snapshot import BackgroundSnapshot, Selector, split_snapshot
from .save import LocalWrite, SavePlanCache, prepare_save
from .async_request import AsyncSaveRequest
from .stats import format_bytes

logger = logging.getLogger(__name__)

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
        the request's ``wait_snapshot()`` returns (:mod:`.background_snapshot`).

        Returns:
            The request: ``wait()`` (or the next save, or :meth:`finalize`) raises its error on every rank."""
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
                    and async_pending.reserve_target(prep.target, prep.store))
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
        first save (see :meth:`StagingPool.reserve`); a save of another size reallocates as before.
        ``on_accelerator``: the state lives on an accelerator (the pool is pinned unless ``pin_memory=False``)."""
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
            self._commit_group = (dist.group.WORLD, new_gloo_group(world))
        return Comm(self._commit_group[1], comm.rank, comm.size)
