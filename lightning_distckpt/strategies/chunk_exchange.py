"""The machinery shared by the loaders that read each unique chunk once and exchange it:
per-rank execution of an :class:`~lightning_distckpt.planning.exchange_plan.ExchangePlan`
(read -> copy to the communication device -> broadcast / send -> copy into place), with its
memory accounting and per-stage timings, and the collective load driver around it.

The data travels as raw bytes (uint8 views), so any dtype goes over any backend. The
communication device follows the group's backend: CPU for gloo (and mpi), the accelerator for
nccl and other accelerator backends. Reads always land on the CPU first (tensorstore), straight
in the destination tensor when that is a contiguous CPU tensor.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, Deque, Dict, List, Optional, Sequence, Set, Tuple

import torch
import torch.distributed as dist

from ..comm import Comm
from ..core.errors import CheckpointingError
from ..core.mapping import ShardedTensor
from ..core.strict import StrictHandling
from ..planning.exchange_plan import BROADCAST, LOCAL, ChunkId, ChunkRequest, ExchangeOp, ExchangePlan, chunk_id, plan_exchange
from .load import LoadRequest, OpenedCheckpoint, assemble, make_request, match_keys, read_objects, read_tensors
from ..storage.tensorstore_io import TensorStoreIO
from .stats import log_throughput

logger = logging.getLogger("lightning_distckpt")


@dataclass
class LoadStats:
    """One rank's account of a load (seconds and bytes).

    read_s: time spent reading from storage (in the reader thread when pipelined);
    read_wait_s: time the exchange waited for a read to finish (reads not hidden by overlap);
    copy_s: host/device copies (into comm buffers, out of them, into the destinations);
    comm_s: time waiting for broadcasts / sends / receives to complete;
    total_s: the whole load on this rank, metadata exchange and common state included.
    peak_inflight_bytes: the most bytes of ops admitted and not yet finished at once;
    peak_extra_bytes: the most bytes of buffers the loader allocated itself at once (reads that
    land in the destinations and receives into them allocate nothing).
    """

    rank: int = 0
    read_s: float = 0.0
    read_wait_s: float = 0.0
    copy_s: float = 0.0
    comm_s: float = 0.0
    total_s: float = 0.0
    bytes_read: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    ops: int = 0
    peak_inflight_bytes: int = 0
    peak_extra_bytes: int = 0
    inflight_limit: Optional[int] = None


def comm_device(group: Optional[dist.ProcessGroup]) -> torch.device:
    """The device collectives on ``group`` take: CPU for gloo/mpi, else the current accelerator."""
    if not (dist.is_available() and dist.is_initialized()):
        return torch.device("cpu")
    backend = str(dist.get_backend(group)).lower()
    if "gloo" in backend or "mpi" in backend:
        return torch.device("cpu")
    if "nccl" in backend:
        return torch.device("cuda", torch.cuda.current_device())
    acc = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    if acc is None:
        raise CheckpointingError(f"process group backend {backend!r} needs an accelerator, but none is available")
    return torch.device(acc.type, torch.accelerator.current_device_index())


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor."""
    return t.reshape(-1).view(torch.uint8)


@dataclass
class _Slot:
    """This rank's state for one op between admission and completion."""

    op: ExchangeOp
    index: int  # position in the global op list (message tag)
    cost: int
    targets: List[torch.Tensor] = field(default_factory=list)  # CPU read targets (src only)
    comm: Optional[torch.Tensor] = None  # uint8 tensor on the comm device
    comm_is_dest: bool = False
    extra: int = 0  # bytes allocated for this op
    read: Optional["Future[Tuple[int, float, Optional[str]]]"] = None
    works: List[Any] = field(default_factory=list)


class ChunkExchange:
    """Executes this rank's part of an exchange plan into the local destination tensors.

    ``local`` maps each chunk this rank asked for to its requesting ShardedTensors. After a run,
    ``results`` maps ``id(sharded_tensor)`` to the loaded tensor (its ``data`` when given) and
    ``errors`` lists read failures (reported collectively by the driver).
    """

    def __init__(self, ckpt: OpenedCheckpoint, comm: Comm, plan: ExchangePlan,
                 local: Dict[ChunkId, List[ShardedTensor]], device: torch.device) -> None:
        self.ckpt, self.comm, self.plan, self.device = ckpt, comm, plan, device
        self.local = local
        self.stats = LoadStats(rank=comm.rank)
        self.errors: List[str] = []
        self.inflight = 0
        self.extra = 0
        self.results: Dict[int, torch.Tensor] = {}
        self.io = ckpt.reader()  # one reader: stores and arrays opened once
        self._pin = device.type != "cpu"
        # One destination per chunk: the first requester's data, or a fresh CPU tensor.
        self.dest: Dict[ChunkId, torch.Tensor] = {}
        for c, sts in local.items():
            st = sts[0]
            shape = st.local_shape if st.flattened_range is None else (st.flattened_range.stop - st.flattened_range.start,)
            # detach: parameters (keep_vars) are written in place, outside autograd
            self.dest[c] = st.data.detach() if st.data is not None else torch.empty(shape, dtype=st.dtype)
        indexed = [(i, op) for i, op in enumerate(plan.ops) if op.involves(comm.rank)]
        self.my_ops = [op for _, op in indexed]
        self.op_index = [i for i, _ in indexed]

    # -- memory planning -------------------------------------------------------------------
    def _on_comm_device(self, t: torch.Tensor) -> bool:
        return t.device == self.device and t.is_contiguous()

    @staticmethod
    def _cpu_direct(t: torch.Tensor) -> bool:
        return t.device.type == "cpu" and t.is_contiguous()

    def planned_extra(self, op: ExchangeOp) -> int:
        """Bytes of buffers this rank allocates for ``op`` (see :meth:`admit`)."""
        extra = 0
        single = len(op.chunks) == 1
        if op.src == self.comm.rank:
            extra += sum(n for c, n in zip(op.chunks, op.sizes) if not self._cpu_direct(self.dest[c]))
            if op.transport != LOCAL:
                if not single:
                    extra += op.nbytes
                elif self.device.type != "cpu" and not self._on_comm_device(self.dest[op.chunks[0]]):
                    extra += op.nbytes
        elif not single or not self._on_comm_device(self.dest[op.chunks[0]]):
            extra += op.nbytes
        return extra

    def cost(self, op: ExchangeOp) -> int:
        """What an op counts against the in-flight bound: its bytes, or its buffers if more."""
        return max(op.nbytes, self.planned_extra(op))

    def _alloc(self, slot: _Slot, shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        t = torch.empty(tuple(shape), dtype=dtype, device=device, pin_memory=self._pin and device.type == "cpu")
        n = t.numel() * t.element_size()
        slot.extra += n
        self.extra += n
        self.stats.peak_extra_bytes = max(self.stats.peak_extra_bytes, self.extra)
        return t

    # -- the stages ------------------------------------------------------------------------
    def admit(self, k: int) -> _Slot:
        """Reserve budget for this rank's ``k``-th op and allocate its buffers (main thread)."""
        op = self.my_ops[k]
        slot = _Slot(op, self.op_index[k], self.cost(op))
        self.inflight += slot.cost
        self.stats.peak_inflight_bytes = max(self.stats.peak_inflight_bytes, self.inflight)
        me = self.comm.rank
        if op.src == me:
            for c in op.chunks:
                d = self.dest[c]
                slot.targets.append(d if self._cpu_direct(d) else self._alloc(slot, d.shape, d.dtype, torch.device("cpu")))
            if op.transport != LOCAL:
                if len(op.chunks) > 1:
                    slot.comm = self._alloc(slot, (op.nbytes,), torch.uint8, self.device)
                elif self.device.type == "cpu":
                    slot.comm = _bytes(slot.targets[0])
                elif self._on_comm_device(self.dest[op.chunks[0]]):
                    slot.comm, slot.comm_is_dest = _bytes(self.dest[op.chunks[0]]), True
                else:
                    slot.comm = self._alloc(slot, (op.nbytes,), torch.uint8, self.device)
        else:
            d = self.dest[op.chunks[0]]
            if len(op.chunks) == 1 and self._on_comm_device(d):
                slot.comm, slot.comm_is_dest = _bytes(d), True
            else:
                slot.comm = self._alloc(slot, (op.nbytes,), torch.uint8, self.device)
        return slot

    def read_job(self, slots: Sequence[_Slot]) -> Tuple[int, float, Optional[str]]:
        """Read the chunks of ``slots`` (this rank is their src) into their CPU targets; no
        collectives, so it may run in a reader thread. Returns (bytes, seconds, error)."""
        t0 = time.perf_counter()
        views = [replace(self.local[c][0], data=t) for s in slots for c, t in zip(s.op.chunks, s.targets)]
        try:
            _, nbytes = read_tensors(self.ckpt, views, set(), io=self.io)
            return nbytes, time.perf_counter() - t0, None
        except Exception as e:  # reported on every rank at the end; the sends still happen
            return 0, time.perf_counter() - t0, f"{type(e).__name__}: {e}"

    def _account_read(self, fut: "Future[Tuple[int, float, Optional[str]]]") -> None:
        nbytes, seconds, error = fut.result()
        self.stats.bytes_read += nbytes
        self.stats.read_s += seconds
        if error and error not in self.errors:
            self.errors.append(error)

    def post(self, slot: _Slot) -> None:
        """Start the op's communication (main thread, in plan order on every rank)."""
        op, me, g = slot.op, self.comm.rank, self.comm.group
        if op.src == me:
            t0 = time.perf_counter()
            assert slot.read is not None
            slot.read.result()
            self.stats.read_wait_s += time.perf_counter() - t0
            if slot.comm is None:
                return
            t0 = time.perf_counter()
            if len(op.chunks) > 1:
                o = 0
                for t, n in zip(slot.targets, op.sizes):
                    slot.comm[o:o + n].copy_(_bytes(t))
                    o += n
            elif slot.comm_is_dest:
                self.dest[op.chunks[0]].copy_(slot.targets[0])
            elif slot.comm.device.type != "cpu":
                slot.comm.copy_(_bytes(slot.targets[0]))
            self.stats.copy_s += time.perf_counter() - t0
            if op.transport == BROADCAST:
                slot.works.append(dist.broadcast(slot.comm, group_src=op.src, group=g, async_op=True))
            else:
                for r in op.receivers:
                    slot.works.append(dist.isend(slot.comm, group_dst=r, group=g, tag=slot.index))
            self.stats.bytes_sent += op.nbytes * (1 if op.transport == BROADCAST else len(op.receivers))
        else:
            if op.transport == BROADCAST:
                slot.works.append(dist.broadcast(slot.comm, group_src=op.src, group=g, async_op=True))
            else:
                slot.works.append(dist.irecv(slot.comm, group_src=op.src, group=g, tag=slot.index))
            self.stats.bytes_received += op.nbytes
        self.stats.ops += 1

    def done(self, slot: _Slot) -> bool:
        return all(w.is_completed() for w in slot.works)

    def complete(self, slot: _Slot) -> None:
        """Wait for the op's communication, copy into the destinations, free its buffers."""
        op = slot.op
        t0 = time.perf_counter()
        for w in slot.works:
            w.wait()
        t1 = time.perf_counter()
        self.stats.comm_s += t1 - t0
        if op.src == self.comm.rank:
            for c, t in zip(op.chunks, slot.targets):
                d = self.dest[c]
                if t is not d and not slot.comm_is_dest:
                    d.copy_(t)
                self._deliver(c)
        else:
            o = 0
            for c, n in zip(op.chunks, op.sizes):
                d = self.dest[c]
                if not slot.comm_is_dest:
                    piece = slot.comm[o:o + n]
                    if d.is_contiguous():
                        _bytes(d).copy_(piece)
                    else:  # clone: a bucket offset need not be aligned for a view as d.dtype
                        d.copy_(piece.clone().view(d.dtype).view(d.shape))
                o += n
                self._deliver(c)
        self.stats.copy_s += time.perf_counter() - t1
        self.inflight -= slot.cost
        self.extra -= slot.extra
        slot.targets, slot.comm = [], None

    def _deliver(self, c: ChunkId) -> None:
        """Record the loaded tensor for every local request of chunk ``c``."""
        d = self.dest[c]
        for i, st in enumerate(self.local[c]):
            if st.data is not None:
                if i > 0:
                    st.data.detach().copy_(d.reshape(st.data.shape))
                self.results[id(st)] = st.data
            else:
                out = d if i == 0 else d.clone()
                self.results[id(st)] = out.view(st.local_shape) if st.flattened_range is None else out

    # -- schedules -------------------------------------------------------------------------
    def run_batch(self) -> None:
        """Read everything this rank reads in one batch, then exchange all ops (no bound)."""
        slots = [self.admit(k) for k in range(len(self.my_ops))]
        mine = [s for s in slots if s.op.src == self.comm.rank]
        fut: "Future[Tuple[int, float, Optional[str]]]" = Future()
        fut.set_result(self.read_job(mine))
        self._account_read(fut)
        for s in mine:
            s.read = fut
        for s in slots:
            self.post(s)
        for s in slots:
            self.complete(s)

    def run_streaming(self, max_inflight: int, read_batch_bytes: int) -> None:
        """Pipelined: a reader thread reads ahead (up to ``read_batch_bytes`` per tensorstore
        batch) while earlier ops are on the wire, with at most ``max_inflight`` bytes admitted at
        once (an op larger than that goes alone)."""
        self.stats.inflight_limit = max_inflight
        n = len(self.my_ops)
        admitted: Dict[int, _Slot] = {}
        pending: Deque[_Slot] = deque()
        to_read: "queue.SimpleQueue[Optional[_Slot]]" = queue.SimpleQueue()
        batches: List[Tuple[int, float, Optional[str]]] = []
        reader = threading.Thread(target=self._reader, args=(to_read, read_batch_bytes, batches),
                                  name="distckpt-reader", daemon=True)
        reader.start()
        next_admit = 0

        def admit_next() -> None:
            nonlocal next_admit
            slot = self.admit(next_admit)
            if slot.op.src == self.comm.rank:
                slot.read = Future()
                to_read.put(slot)
            admitted[next_admit] = slot
            next_admit += 1

        def fits(k: int) -> bool:
            return self.inflight == 0 or self.inflight + self.cost(self.my_ops[k]) <= max_inflight

        try:
            for j in range(n):
                while next_admit <= j:
                    if fits(next_admit):
                        admit_next()
                    else:  # ops before j are all posted, so one is pending: finish it to make room
                        self.complete(pending.popleft())
                while next_admit < n and fits(next_admit):
                    admit_next()  # read ahead
                slot = admitted.pop(j)
                self.post(slot)
                pending.append(slot)
                while pending and self.done(pending[0]):
                    self.complete(pending.popleft())
            while pending:
                self.complete(pending.popleft())
        finally:
            to_read.put(None)
            reader.join()
        for nbytes, seconds, error in batches:
            self.stats.bytes_read += nbytes
            self.stats.read_s += seconds
            if error and error not in self.errors:
                self.errors.append(error)

    def _reader(self, to_read: "queue.SimpleQueue[Optional[_Slot]]", batch_bytes: int,
                batches: List[Tuple[int, float, Optional[str]]]) -> None:
        """Reader thread: reads queued slots in order, several per tensorstore batch."""
        stop = False
        while not stop:
            first = to_read.get()
            if first is None:
                return
            batch, size = [first], first.op.nbytes
            while size < batch_bytes:
                try:
                    nxt = to_read.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    stop = True
                    break
                batch.append(nxt)
                size += nxt.op.nbytes
            batches.append(self.read_job(batch))
            for s in batch:
                assert s.read is not None
                s.read.set_result((0, 0.0, None))


def group_local_requests(tensors: Sequence[ShardedTensor], skip: Set[str]) -> Tuple[Dict[ChunkId, List[ShardedTensor]], List[ShardedTensor]]:
    """(chunk -> requesting tensors, zero-size tensors read locally), skipping keys in ``skip``."""
    local: Dict[ChunkId, List[ShardedTensor]] = {}
    empty: List[ShardedTensor] = []
    for st in tensors:
        if st.key in skip:
            continue
        if st.local_nbytes() == 0:
            empty.append(st)
        else:
            local.setdefault(chunk_id(st), []).append(st)
    return local, empty


def exchange_load(
    sharded_state_dict: Dict[str, Any],
    checkpoint_dir: str,
    comm: Comm,
    exchange_comm: Comm,
    strict: StrictHandling,
    extra_safe_globals: Sequence[Any],
    run: Callable[[ChunkExchange], None],
    *,
    bucket_bytes: int,
    device: Optional[torch.device] = None,
    op_name: str = "load",
) -> Tuple[Dict[str, Any], Set[str], Set[str], List[LoadStats]]:
    """Collective load over ``comm`` where chunks are deduplicated and exchanged within
    ``exchange_comm`` (the whole ``comm`` or a subgroup of it, e.g. a data-parallel group).

    Errors anywhere (bad template, unreadable chunk) are gathered and raised on every rank of
    ``comm``; a rank whose read failed still takes part in the exchange so no rank hangs.
    Returns (state, missing, unexpected, per-rank stats of ``comm``).
    """
    t0 = time.perf_counter()
    ckpt = OpenedCheckpoint.open(checkpoint_dir)
    error: Optional[str] = None
    try:
        req = make_request(sharded_state_dict)
    except CheckpointingError as e:  # keep taking part in the collectives, fail at the end
        error, req = str(e), LoadRequest({}, [], [])
    missing, unexpected = match_keys(ckpt, req, comm, strict)
    local, empty = group_local_requests(req.tensors, missing)
    requests = exchange_comm.all_gather_object([ChunkRequest(c, sts[0].local_nbytes()) for c, sts in local.items()])
    plan = plan_exchange(requests, bucket_bytes=bucket_bytes)
    engine = ChunkExchange(ckpt, exchange_comm, plan, local, device or comm_device(exchange_comm.group))
    state: Dict[str, Any] = {}
    try:
        run(engine)
    except RuntimeError as e:  # a collective failed: a rank died or timed out; no point in going on
        raise CheckpointingError(
            f"load from {ckpt.path}: rank {comm.rank}: chunk exchange over {exchange_comm.size} ranks failed "
            f"(a rank may have died or timed out): {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        ) from e
    if engine.errors and error is None:
        more = len(engine.errors) - 3
        error = "; ".join(engine.errors[:3]) + (f"; and {more} more read errors" if more > 0 else "")
    if error is None:
        try:
            tensors = dict(engine.results)
            if empty:
                tensors.update(read_tensors(ckpt, empty, set())[0])
            objects = read_objects(ckpt, req.objects, missing, extra_safe_globals)
            state = assemble(req, ckpt.load_common(extra_safe_globals), tensors, objects)
        except CheckpointingError as e:
            error = str(e)
    engine.stats.total_s = time.perf_counter() - t0
    gathered = comm.all_gather_object((error, asdict(engine.stats)))
    failures = [(rk, err) for rk, (err, _) in enumerate(gathered) if err]
    if failures:
        raise CheckpointingError(
            f"load from {ckpt.path} failed: " + "; ".join(f"rank {rk}: {err}" for rk, err in failures)
        )
    stats = [LoadStats(**s) for _, s in gathered]
    for rk, s in enumerate(stats):
        s.rank = rk
    log_throughput(op_name, ckpt.path, comm.rank, [(s.bytes_read, s.read_s) for s in stats], time.perf_counter() - t0)
    return state, missing, unexpected, stats


def format_load_times(stats: Sequence[LoadStats]) -> str:
    """A per-rank table of stage times and bytes."""
    head = f"{'rank':>4} {'read_s':>8} {'wait_s':>8} {'copy_s':>8} {'comm_s':>8} {'total_s':>8} " \
           f"{'read_MB':>9} {'sent_MB':>9} {'recv_MB':>9} {'inflight_MB':>11} {'extra_MB':>8}"
    rows = [head]
    for s in stats:
        rows.append(
            f"{s.rank:>4} {s.read_s:>8.3f} {s.read_wait_s:>8.3f} {s.copy_s:>8.3f} {s.comm_s:>8.3f} {s.total_s:>8.3f} "
            f"{s.bytes_read / 1e6:>9.2f} {s.bytes_sent / 1e6:>9.2f} {s.bytes_received / 1e6:>9.2f} "
            f"{s.peak_inflight_bytes / 1e6:>11.2f} {s.peak_extra_bytes / 1e6:>8.2f}"
        )
    return "\n".join(rows)
