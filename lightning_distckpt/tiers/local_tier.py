"""LocalTier: node-local checkpoints with partner copies, and recovery from the fastest tier that survived.

Every method but ``begin`` and ``reserve_staging`` (local) is collective over the tier's group
(``process_group``, default the world). The tier talks over a gloo group of its own (:mod:`.groups`:
made by the first tier over these ranks with
``dist.new_group``, so that constructor is collective over the world group, and reused by later tiers
over the same ranks for the life of the process): the local save's background thread (commit,
replication, pruning) talks over it only, so it never races the training's collectives; the caller's
thread uses it only while no background work runs (``save`` and the other methods first wait for it).
A tier whose group a newer tier took is finished (its background work first) and refuses further use.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import threading
import weakref
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch.distributed as dist

from lightning_distckpt.comm import Comm
from lightning_distckpt.core.errors import ArgumentError, ArgumentTypeError
from lightning_distckpt.core.plain_tensors import tree_to_save
from lightning_distckpt.saving.async_save import AsyncSaver
from lightning_distckpt.saving.priority import lower_thread
from lightning_distckpt.tiers.context import TierContext
from lightning_distckpt.tiers.groups import GroupUser, tier_group
from lightning_distckpt.tiers.holdings import StepInfo
from lightning_distckpt.tiers.local_save import finish_local_save, make_room
from lightning_distckpt.tiers.node_store import NodeLocalStore
from lightning_distckpt.tiers.nodes import gather_nodes
from lightning_distckpt.tiers.options import RecoveryPoint, TierOptions
from lightning_distckpt.tiers.private_root import ensure_private_root
from lightning_distckpt.reading.shared_source import SharedCopy
from lightning_distckpt.tiers.recover import DurableReader, Prepare, ReadyCopy, load_local, prepared, recoverable
from lightning_distckpt.tiers.root_lock import RootClaim, claim_root

logger = logging.getLogger(__name__)


def _tier_comm(process_group: Optional[dist.ProcessGroup], user: GroupUser) -> Comm:
    """The tiers' gloo group over ``process_group``'s ranks (the world's by default), now ``user``'s; or
    none without torch.distributed."""
    if not (dist.is_available() and dist.is_initialized()):
        if process_group is not None:
            raise ArgumentError("LocalTier: a process_group was given but torch.distributed is not initialized")
        return Comm(None, 0, 1)
    ranks = tuple(dist.get_process_group_ranks(process_group)) if process_group is not None else None
    group = tier_group(ranks, user)
    if group is None or group == dist.GroupMember.NON_GROUP_MEMBER:
        raise ArgumentError("LocalTier: this rank is not in the process_group it was given")
    return Comm(group, dist.get_rank(group), dist.get_world_size(group))


def _saver(options: TierOptions) -> AsyncSaver:
    """The tier's AsyncSaver, under the staging budget where AsyncSaver takes one."""
    if options.max_staging_bytes is not None and "max_staging_bytes" in inspect.signature(AsyncSaver).parameters:
        return AsyncSaver(max_staging_bytes=options.max_staging_bytes)
    return AsyncSaver()


def _check_step(step: Any, method: str) -> None:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ArgumentError(f"LocalTier.{method}: step must be an int >= 0, got {step!r}")


def _check_run(run: Any) -> None:
    if run is not None and (not isinstance(run, str) or not 0 < len(run) <= 200 or not run.isprintable()):
        raise ArgumentError(f"LocalTier: run must be None or a printable str of 1 to 200 characters, got {run!r}")


class LocalTier:
    """The node-local tier of one rank (every rank of the group makes one, with the same options;
    collective over ``process_group``, default the world). ``options``: a :class:`TierOptions`.

    ``run`` names the run (rank 0's decides): its saves record it, and only steps saved under the same run
    are recovered, so a job that finds another job's steps on its root (one run before it there, the
    lock released between) never resumes them as its own. A restart of the same run passes the same name
    (the Trainer's ``TierCheckpoint`` keeps it in its marker). None: saves record none and every step counts.
    """

    def __init__(self, options: TierOptions, process_group: Optional[dist.ProcessGroup] = None,
                 run: Optional[str] = None) -> None:
        if not isinstance(options, TierOptions):
            raise ArgumentTypeError(f"LocalTier: options must be a TierOptions, got {type(options).__name__}")
        self.options = options
        self.process_group = process_group
        self._thread: Optional[threading.Thread] = None
        self._room: Optional[threading.Thread] = None  # the lead making room for the next save (begin)
        self._room_step: Optional[int] = None  # the step room was made (or is being made) for
        self._error: Optional[BaseException] = None
        self._closed = False
        self._superseded = False
        comm = _tier_comm(process_group, self)
        nodes, root = gather_nodes(options, comm)
        error: Optional[Exception] = None
        self._claim = RootClaim()
        try:
            _check_run(run)
            ensure_private_root(root)
            if nodes.is_lead(comm.rank):  # one job per node root at a time (tiers/root_lock.py)
                self._claim = claim_root(root)
                weakref.finalize(self, self._claim.release, False)  # a tier dropped unclosed: unlocked only
        except Exception as e:  # agreed: every rank raises it, none waits in a later collective
            error = e
        try:
            runs = comm.agree("local tier: preparing the node-local directories", error, run)
        except BaseException:
            self._claim.release()
            raise
        self._ctx = TierContext(options, comm, nodes, root, runs[0])  # rank 0's run: the same on every rank
        self._saver = _saver(options)
        self._ready: Dict[int, ReadyCopy] = {}  # steps an earlier load completed here (forgotten at a save)
        self._holdings: Optional[List[StepInfo]] = None  # what recoverable() listed, for the load that follows
        self._durable: List[Tuple[int, str]] = []  # the durable checkpoints recoverable() checked (rank 0's)
        #: The point the latest :meth:`load` read: the one asked for, or where a damaged copy made it fall back.
        self.last_point: Optional[RecoveryPoint] = None

    @property
    def node(self) -> str:
        """This rank's node name."""
        return self._ctx.node

    @property
    def run(self) -> Optional[str]:
        """The run this tier saves as and recovers (rank 0's ``run``)."""
        return self._ctx.run

    def start_run(self, run: Optional[str]) -> None:
        """Collective (waits for the background work, as :meth:`wait`). From now on saves record ``run`` and
        only its steps are recovered: a job that found another run's name (the Trainer's marker of another
        job) and does not resume it."""
        self._check_open()
        _check_run(run)
        self.wait()
        self._ctx = dataclasses.replace(self._ctx, run=run)
        self._ready.clear()
        self._holdings = None

    @property
    def root(self) -> str:
        """This node's local root (``local_dir`` with ``{node}`` replaced)."""
        return self._ctx.root

    def begin(self, step: int) -> None:
        """Optional, ahead of :meth:`save` of ``step`` (e.g. as the training step that ends at ``step``
        starts): this node's lead makes room for it (removes the oldest step directory beyond
        ``keep_local``) on a helper thread, once the previous local save's background work is done (not
        after one that failed: its error is raised by ``save``), so the removal overlaps the training
        instead of blocking the save; :meth:`save` waits for it before anything is written. Returns at
        once; enters no collective; again for the same step, nothing."""
        self._check_open()
        _check_step(step, "begin")
        if self._room_step != step:
            self._begin(step, background=True)

    def save(self, sharded_state_dict: Dict[str, Any], step: int) -> None:
        """Collective. Waits for the previous local save (and its replication) to finish (raising what
        failed), then snapshots this rank's shards of ``sharded_state_dict`` as ``step`` and returns; writing,
        commit, replication to partners and pruning finish on the tier's thread."""
        self._check_open()
        _check_step(step, "save")
        if self._room_step != step:  # no begin(step): room is made now
            self._begin(step, background=False)
        self.wait()  # the room made (no rank writes before the leads enter the save's handshake)
        self._room_step = None
        store = NodeLocalStore.for_save(self._ctx.location(step), self._ctx.run)  # the run: in its commit marker
        # prepared as the durable save prepares it: plain tensors (a Trainer's callback scores, rank 0's alone)
        # are stored tensors, not common state that would differ by rank
        comm = self._ctx.comm
        request = self._saver.save(tree_to_save(sharded_state_dict, comm.rank, comm.size), store, comm=comm)
        self._thread = threading.Thread(target=self._finish, args=(request, step), name="distckpt-local-tier",
                                        daemon=True)
        self._thread.start()

    def _begin(self, step: int, background: bool) -> None:
        """The lead makes room for ``step``: on a helper thread after the previous save's (``background``),
        else now, after waiting for the previous save (raising what failed)."""
        room, self._room = self._room, None
        if room is not None:  # an earlier begin's
            room.join()
        if not background:
            self.wait()
        self._ready.clear()  # the save may prune or replace what an earlier load completed
        self._holdings = None
        self._room_step = step
        if not self._ctx.is_lead:  # room first: with a staging budget the save writes much before it returns
            return
        if background:
            self._room = threading.Thread(target=self._make_room_after, args=(self._thread, step),
                                          name="distckpt-local-tier-room", daemon=True)
            self._room.start()
        else:
            make_room(self._ctx, step)

    def _make_room_after(self, previous: Optional[threading.Thread], step: int) -> None:
        """The room thread: the previous save's background work first (its pruning, its directories);
        after a failed one nothing is removed (the save raises its error before writing)."""
        if previous is not None:
            previous.join()
        if self._error is None:
            make_room(self._ctx, step)

    def reserve_staging(self, nbytes: int, on_accelerator: bool = False) -> None:
        """Local: allocate the snapshot's staging memory for an expected ``nbytes`` on this rank (capped
        at ``max_staging_bytes``) and fault its pages in on a thread of its own, ahead of the first
        save, which otherwise pays them (:meth:`AsyncSaver.reserve_staging`, ``on_accelerator`` as there)."""
        self._check_open()
        self._saver.reserve_staging(nbytes, on_accelerator)

    def _finish(self, request: Any, step: int) -> None:
        # like the saver's writing thread: the training comes first
        lower_thread(threading.get_native_id(), getattr(self._saver, "nice", 0))
        try:
            finish_local_save(self._ctx, request, step)
        except BaseException as e:  # raised on the caller's thread by wait() / the next save()
            self._error = e

    def wait(self) -> None:
        """Collective. Finishes the in-flight local save and replication (raises what failed)."""
        room, self._room = self._room, None
        if room is not None:  # make_room logs what failed: nothing to raise
            room.join()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()
        error, self._error = self._error, None
        if error is not None:
            raise error

    def recoverable(self, durable: Sequence[Tuple[int, str]] = (), *, files: bool = False) -> Optional[RecoveryPoint]:
        """Collective. The newest step for which every shard is held and verified somewhere: this node's
        local tier, a partner's copy, or one of the given durable checkpoints ``(step, location)`` (rank
        0's list decides; at equal steps the local tiers win). The same answer on every rank (or the same
        error); None when nothing is recoverable. Waits for a local save in flight first. ``files``: a durable
        checkpoint that is a file (a ``torch.save`` ``.ckpt``) counts, for a caller that reads durable points with
        its own ``durable_reader`` (:meth:`load`); ``lightning_distckpt.load`` reads directories only."""
        self._check_open()
        self.wait()
        self._room_step = None  # what was listed (and may be fetched next) stays until a save makes room again
        point, self._holdings, self._durable = recoverable(self._ctx, durable, files)
        return point

    def load(self, sharded_state_dict: Dict[str, Any], point: RecoveryPoint, *, prepare: Optional[Prepare] = None,
             durable_reader: Optional[DurableReader] = None, **load_kwargs: Any) -> Any:
        """Collective. Loads ``point`` into ``sharded_state_dict`` as ``lightning_distckpt.load`` would (same return
        value, common state included, same resharding): from the durable checkpoint for a durable point; else after
        completing this node's copy from the partners' (over torch.distributed), from this node's local
        directory. ``load_kwargs`` go to ``lightning_distckpt.load`` (not ``process_group``: the tier's).

        A local copy failing its checksums as it is read is not used (WARNING naming it): the load falls
        back, agreed by every rank, to another copy of the step; for the first load after
        :meth:`recoverable`, else to the newest step still recoverable (an older local one, or a durable
        checkpoint it was given). :attr:`last_point` says which point was read.

        ``prepare(source)``, before each read, on every rank (agreed): given the opened checkpoint about to be
        read, it may fit the template to the keys it stores (in place) and returns the source to read (it, or a
        view of it); not with ``key_map`` / ``storage``, which choose how the load opens it.

        ``durable_reader(point)``: reads a durable point (given, or fallen back to) instead of
        ``lightning_distckpt.load``, and its value is returned: a Trainer's or Fabric's own restore of that
        checkpoint, which reads the layouts a durable ``last.ckpt`` may have (a ``torch.save`` file, ...)."""
        from lightning_distckpt.serialization import load

        self._check_open()
        if not isinstance(point, RecoveryPoint):
            raise ArgumentTypeError(f"LocalTier.load: point must be a RecoveryPoint, got {type(point).__name__}")
        if "process_group" in load_kwargs:
            raise ArgumentError("LocalTier.load: the tier's process_group is used; do not pass one")
        if prepare is not None and {"key_map", "storage"} & set(load_kwargs):
            raise ArgumentError("LocalTier.load: prepare is not taken with key_map or storage")
        self.wait()
        self._room_step = None
        if point.source == "durable":
            self.last_point = point
            if durable_reader is not None:
                return durable_reader(point)
            target: Any = point.path if prepare is None else prepared(self._ctx, SharedCopy(point.path), prepare)
            return load(sharded_state_dict, target, process_group=self.process_group, **load_kwargs)
        holdings, self._holdings = self._holdings, None  # stale once a load completed this node's copy
        # Only the first load after recoverable() may fall back to another step: nothing was restored yet.
        durable = self._durable if holdings is not None else None
        out, self.last_point = load_local(self._ctx, point, sharded_state_dict, self.process_group, load_kwargs,
                                          self._ready, holdings, durable, prepare, durable_reader)
        return out

    def close(self) -> None:
        """Finishes what is in flight (raising what failed); the tier is unusable afterwards. (Its gloo
        group stays until the process group is destroyed: destroying a subgroup is not safe everywhere.)"""
        if self._closed:
            return
        self._closed = True
        try:
            self.wait()
        finally:
            self._claim.release()

    def quiesce(self) -> None:
        """A newer tier over the same ranks takes the group: finish the background work (what failed is
        raised by ``wait``/``close``), and refuse further use."""
        self._superseded = True
        for thread in (self._room, self._thread):
            if thread is not None:
                thread.join()
        self._claim.release()

    def _check_open(self) -> None:
        if self._closed:
            raise ArgumentError("LocalTier: used after close()")
        if self._superseded:
            raise ArgumentError("LocalTier: used after a newer LocalTier over the same ranks took its group "
                                "(one tier per process at a time)")
