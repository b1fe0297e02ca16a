"""The exchange engine shared by the fully parallel and two-stage loaders: executes this rank's part of an
:class:`~lightning_distckpt.planning.exchange_plan.ExchangePlan` (read -> copy to the communication device ->
broadcast / send -> copy into place), with its memory accounting and per-stage timings, on one of two schedules:
all reads first then the exchange (:meth:`ChunkExchange.run_batch`), or pipelined under a bound on bytes in
flight (:meth:`ChunkExchange.run_streaming`).

The data travels as raw bytes (uint8 views), so any dtype goes over any backend. The communication device
follows the group's backend: CPU for gloo (and mpi), the accelerator for nccl and other accelerator backends.
Reads always land on the CPU first, straight in the destination tensor when that is a contiguous CPU tensor.
"""

from __future__ import annotations

import queue
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Deque, Dict, Iterable, List, Optional, Sequence

import torch

from ..comm import Comm, Pending
from ..comm_bytes import backend_refs, settle
from ..core.tensor_bytes import byte_view
from ..planning.exchange_plan import BROADCAST, LOCAL, ChunkId, ExchangeOp, ExchangePlan
from .buckets import gather_bytes, scatter_bytes
from .checkpoint import CheckpointSource
from .exchange_guard import (allocate, cpu_direct, on_comm_device, op_buffers, stage_error, start_thread,
                             take_part)
from .reads import ReadOutcome, ReadTarget, read_shape, read_targets
from .request import Requester
from .stats import LoadStats


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
    read: Optional["Future[None]"] = None  # set once this op's chunks are read
    works: List[Pending] = field(default_factory=list)
    refs: Optional[int] = None  # references to ``comm`` before its messages (comm_bytes.settle)


class ChunkExchange:
    """Executes this rank's part of an exchange plan into the local destination tensors.

    ``local`` maps each chunk this rank asked for to its requesters, ``dest`` each to its destination
    (``exchange_guard.prepare``). After a run, ``results`` maps each requester's position to the loaded tensor
    (its ``data`` when given) and ``errors`` lists this rank's failures: reads, copies, buffers (reported
    collectively by the driver: a failing rank still takes part in every op, see :mod:`.exchange_guard`).
    """

    def __init__(self, source: CheckpointSource, comm: Comm, plan: ExchangePlan,
                 local: Dict[ChunkId, List[Requester]], device: torch.device,
                 dest: Dict[ChunkId, torch.Tensor]) -> None:
        self.source, self.comm, self.plan, self.device = source, comm, plan, device
        self.local, self.dest = local, dest
        self.stats = LoadStats(rank=comm.rank)
        self.errors: List[BaseException] = []
        self.inflight = self.extra = 0  # bytes of ops admitted, of buffers allocated
        self.results: Dict[int, torch.Tensor] = {}
        self.io: Any = None  # one reader: stores and arrays opened once (by the first read, whose error it is)
        self._pin = device.type != "cpu"
        self._costs: Dict[int, int] = {}  # id of an op of the plan -> its cost
        indexed = [(i, op) for i, op in enumerate(plan.ops) if op.involves(comm.rank)]
        self.my_ops = [op for _, op in indexed]
        self.op_index = [i for i, _ in indexed]

    # -- memory planning -------------------------------------------------------------------
    def _failed(self, what: str, chunks: Iterable[ChunkId], e: BaseException) -> None:
        """Record this rank's failure (raised on every rank at the end); the exchange goes on. (A chunk of
        the plan is a plain tuple, as gathered: its key first.)"""
        self.errors.append(stage_error(what, (c[0] for c in chunks), e))

    def cost(self, op: ExchangeOp) -> int:
        """What an op counts against the in-flight bound: its bytes, or its buffers if more (kept: the
        schedule asks again, and a bucket of small chunks costs a look at each)."""
        known = self._costs.get(id(op))
        if known is None:
            known = self._costs[id(op)] = max(op.nbytes, op_buffers(op, self.comm.rank, self.dest, self.device))
        return known

    def _alloc(self, slot: _Slot, shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        t = allocate(shape, dtype, device, self._pin and device.type == "cpu", slot.op.chunks[0][0])
        n = t.numel() * t.element_size()
        slot.extra += n
        self.extra += n
        self.stats.peak_extra_bytes = max(self.stats.peak_extra_bytes, self.extra)
        return t

    # -- the stages ------------------------------------------------------------------------
    def admit(self, k: int) -> _Slot:
        """Reserve budget for this rank's ``k``-th op and allocate its buffers (main thread). A buffer that
        cannot be allocated raises, with nothing of the op kept: the schedule admits it again later."""
        op = self.my_ops[k]
        slot = _Slot(op, self.op_index[k], self.cost(op))
        self.inflight += slot.cost
        try:
            self._buffers(slot)
        except Exception:
            self._release(slot)
            raise
        self.stats.peak_inflight_bytes = max(self.stats.peak_inflight_bytes, self.inflight)
        return slot

    def _release(self, slot: _Slot) -> None:
        self.inflight -= slot.cost
        self.extra -= slot.extra
        slot.targets, slot.comm, slot.extra = [], None, 0

    def _buffers(self, slot: _Slot) -> None:
        op, me = slot.op, self.comm.rank
        if op.src == me:
            for c in op.chunks:
                d = self.dest[c]
                slot.targets.append(d if cpu_direct(d)
                                    else self._alloc(slot, d.shape, d.dtype, torch.device("cpu")))
            if op.transport != LOCAL:
                if len(op.chunks) > 1:
                    slot.comm = self._alloc(slot, (op.nbytes,), torch.uint8, self.device)
                elif self.device.type == "cpu":
                    slot.comm = byte_view(slot.targets[0])
                elif on_comm_device(self.dest[op.chunks[0]], self.device):
                    slot.comm, slot.comm_is_dest = byte_view(self.dest[op.chunks[0]]), True
                else:
                    slot.comm = self._alloc(slot, (op.nbytes,), torch.uint8, self.device)
        else:
            d = self.dest[op.chunks[0]]
            if len(op.chunks) == 1 and on_comm_device(d, self.device):
                slot.comm, slot.comm_is_dest = byte_view(d), True
            else:
                slot.comm = self._alloc(slot, (op.nbytes,), torch.uint8, self.device)

    def read_job(self, slots: Sequence[_Slot]) -> ReadOutcome:
        """Read the chunks of ``slots`` (this rank is their src) into their CPU targets; no collectives, so it
        may run in a reader thread."""
        t0 = time.perf_counter()
        try:
            if self.io is None:
                self.io = self.source.reader()
            targets = []
            for s in slots:
                for c, t in zip(s.op.chunks, s.targets):
                    st = self.local[c][0].tensor
                    targets.append(ReadTarget(st, t.view(read_shape(st))))
            nbytes = read_targets(self.source, targets, self.io)
            return ReadOutcome(nbytes, time.perf_counter() - t0, None)
        except Exception as e:  # reported on every rank at the end; the sends still happen
            return ReadOutcome(0, time.perf_counter() - t0, e)

    def _account_read(self, outcome: ReadOutcome) -> None:
        self.stats.bytes_read += outcome.nbytes
        self.stats.read_s += outcome.seconds
        if outcome.error is not None:
            self.errors.append(outcome.error)

    def post(self, slot: _Slot) -> None:
        """Start the op's communication (main thread, in plan order on every rank)."""
        op, me, comm = slot.op, self.comm.rank, self.comm
        slot.refs = backend_refs(slot.comm)
        if op.src == me:
            t0 = time.perf_counter()
            assert slot.read is not None
            slot.read.result()
            self.stats.read_wait_s += time.perf_counter() - t0
            if slot.comm is None:
                return
            t0 = time.perf_counter()
            try:
                if len(op.chunks) > 1:
                    gather_bytes(slot.comm, slot.targets, op.sizes)
                elif slot.comm_is_dest:
                    self.dest[op.chunks[0]].copy_(slot.targets[0])
                elif slot.comm.device.type != "cpu":
                    slot.comm.copy_(byte_view(slot.targets[0]))
            except Exception as e:  # the message still goes (its bytes wrong): the load fails on every rank
                self._failed("copying into the message", op.chunks, e)
            self.stats.copy_s += time.perf_counter() - t0
            if op.transport == BROADCAST:
                slot.works.append(comm.broadcast_tensor(slot.comm, op.src))
            else:
                slot.works.extend(comm.isend(slot.comm, r, tag=slot.index) for r in op.receivers)
            self.stats.bytes_sent += op.nbytes * (1 if op.transport == BROADCAST else len(op.receivers))
        else:
            assert slot.comm is not None
            if op.transport == BROADCAST:
                slot.works.append(comm.broadcast_tensor(slot.comm, op.src))
            else:
                slot.works.append(comm.irecv(slot.comm, op.src, tag=slot.index))
            self.stats.bytes_received += op.nbytes
        self.stats.ops += 1

    def done(self, slot: _Slot) -> bool:
        return all(w.is_completed() for w in slot.works)

    def complete(self, slot: _Slot) -> None:
        """Wait for the op's communication, copy into the destinations, free its buffers."""
        op = slot.op
        t0 = time.perf_counter()
        while slot.works:  # none left referenced (a loop variable would keep one): then the backend lets go of
            slot.works.pop().wait()  # the message before Python may (comm_bytes.settle)
        settle(slot.comm, slot.refs)
        t1 = time.perf_counter()
        self.stats.comm_s += t1 - t0
        try:
            if op.src == self.comm.rank:
                for c, t in zip(op.chunks, slot.targets):
                    d = self.dest[c]
                    if t is not d and not slot.comm_is_dest:
                        d.copy_(t)
            elif not slot.comm_is_dest:
                scatter_bytes(slot.comm, [self.dest[c] for c in op.chunks], op.sizes)
        except Exception as e:  # reported on every rank at the end; the exchange goes on
            self._failed("copying into the destination", op.chunks, e)
        for c in op.chunks:
            self._deliver(c)
        self.stats.copy_s += time.perf_counter() - t1
        self._release(slot)

    def _deliver(self, c: ChunkId) -> None:
        """Record the loaded tensor for every local request of chunk ``c``."""
        d = self.dest[c]
        for i, (position, st) in enumerate(self.local[c]):
            try:  # a further request gets a copy (in place, into its data)
                if st.data is not None:
                    if i > 0:
                        st.data.detach().copy_(d.reshape(st.data.shape))
                    self.results[position] = st.data
                else:
                    out = d if i == 0 else d.clone()
                    self.results[position] = out.view(st.local_shape) if st.flattened_range is None else out
            except Exception as e:  # no memory, a destination refusing it: reported on every rank at the end
                self._failed("copying into another request", [c], e)

    # -- schedules -------------------------------------------------------------------------
    def run(self, max_inflight: Optional[int], read_batch_bytes: int) -> None:
        """:meth:`run_batch` when ``max_inflight`` is None, else :meth:`run_streaming`. A failed broadcast,
        send or receive (a rank died or timed out) raises :class:`CollectiveError`: no agreement is possible."""
        direct = self._take_direct_ops()
        outcome: List[ReadOutcome] = []
        # Chunks only this rank needs, landing in their CPU destinations, need no exchange: read them
        # all in one storage batch (the most I/O concurrency, as every-rank reads would), beside the
        # exchange of the shared ones, through a reader of their own (readers are not shared by threads).
        side = start_thread(lambda: outcome.append(self._read_direct(direct)), "distckpt-direct")
        if side is None:  # no thread to be had: read them first
            outcome.append(self._read_direct(direct))
        try:
            if max_inflight is None:
                self.run_batch(read_batch_bytes)
            else:
                self.run_streaming(max_inflight, read_batch_bytes)
        finally:
            if side is not None:
                side.join()
        self._account_read(outcome[0])
        for op in direct:
            for c in op.chunks:
                self._deliver(c)

    def _take_direct_ops(self) -> List[ExchangeOp]:
        """Remove from this rank's schedule the local ops whose chunks all read straight into CPU destinations
        (no buffers: nothing to count against the in-flight bound); return them."""
        direct = [k for k, op in enumerate(self.my_ops)
                  if op.transport == LOCAL and all(cpu_direct(self.dest[c]) for c in op.chunks)]
        taken, keep = [self.my_ops[k] for k in direct], sorted(set(range(len(self.my_ops))) - set(direct))
        self.my_ops, self.op_index = [self.my_ops[k] for k in keep], [self.op_index[k] for k in keep]
        return taken

    def _read_direct(self, ops: Sequence[ExchangeOp]) -> ReadOutcome:
        t0 = time.perf_counter()
        try:
            sts = [(self.local[c][0].tensor, c) for op in ops for c in op.chunks]
            targets = [ReadTarget(st, self.dest[c].view(read_shape(st))) for st, c in sts]
            return ReadOutcome(read_targets(self.source, targets, self.source.reader()) if targets else 0,
                               time.perf_counter() - t0, None)
        except Exception as e:  # reported on every rank at the end
            return ReadOutcome(0, time.perf_counter() - t0, e)

    def run_batch(self, read_batch_bytes: int = 16 << 20) -> None:
        """Read everything this rank reads in one batch, then exchange all ops (no bound). Without room
        for every op's buffers at once: :meth:`run_streaming`, as many at once as there was room for."""
        slots: List[_Slot] = []
        try:
            for k in range(len(self.my_ops)):
                slots.append(self.admit(k))
        except Exception:  # nothing is posted yet: any schedule posts the same ops in the same order
            room = self.inflight
            for s in slots:
                self._release(s)
            return self.run_streaming(max(room, 1), read_batch_bytes)
        mine = [s for s in slots if s.op.src == self.comm.rank]
        self._account_read(self.read_job(mine))
        fut: "Future[None]" = Future()
        fut.set_result(None)
        for s in mine:
            s.read = fut
        for s in slots:
            self.post(s)
        for s in slots:
            self.complete(s)

    def run_streaming(self, max_inflight: int, read_batch_bytes: int) -> None:
        """Pipelined: a reader thread reads ahead (up to ``read_batch_bytes`` per tensorstore batch) while
        earlier ops are on the wire, with at most ``max_inflight`` bytes admitted at once (one larger goes alone)."""
        self.stats.inflight_limit = max_inflight
        n = len(self.my_ops)
        admitted: Dict[int, _Slot] = {}
        pending: Deque[_Slot] = deque()
        to_read: "queue.SimpleQueue[Optional[_Slot]]" = queue.SimpleQueue()
        batches: List[ReadOutcome] = []
        reader = start_thread(lambda: self._reader(to_read, read_batch_bytes, batches), "distckpt-reader")
        next_admit = 0
        failure: Optional[BaseException] = None

        def admit_next() -> bool:
            nonlocal next_admit, failure
            try:
                slot = self.admit(next_admit)
            except Exception as e:  # no room now: admitted again once earlier ops are done
                failure = e
                return False
            if slot.op.src == self.comm.rank:
                slot.read = Future()
                if reader is not None:
                    to_read.put(slot)
                else:  # no reader thread: read here
                    batches.append(self.read_job([slot]))
                    slot.read.set_result(None)
            admitted[next_admit] = slot
            next_admit += 1
            return True

        def fits(k: int) -> bool:
            return self.inflight == 0 or self.inflight + self.cost(self.my_ops[k]) <= max_inflight

        try:
            for j in range(n):
                while next_admit <= j:
                    if fits(next_admit) and admit_next():
                        continue
                    if not pending:  # alone and no room
                        break
                    self.complete(pending.popleft())  # ops before j are all posted: finish one to make room
                if next_admit <= j:  # no room even alone, though there was when tried: the load fails
                    self.errors.append(failure)  # (every earlier op is done) reported on every rank at the end
                    self.results.clear()  # dropped: the copies made for further requests give memory back
                    take_part(self.comm, self.op_index[j:], self.my_ops[j:], self.dest, self.device, failure)
                    break
                while next_admit < n and fits(next_admit) and admit_next():
                    pass  # read ahead
                slot = admitted.pop(j)
                self.post(slot)
                pending.append(slot)
                while pending and self.done(pending[0]):
                    self.complete(pending.popleft())
            while pending:
                self.complete(pending.popleft())
        finally:
            if reader is not None:
                to_read.put(None)
                reader.join()
        for outcome in batches:
            self._account_read(outcome)

    def _reader(self, to_read: "queue.SimpleQueue[Optional[_Slot]]", batch_bytes: int,
                batches: List[ReadOutcome]) -> None:
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
            try:
                batches.append(self.read_job(batch))
            finally:  # the main thread waits for these
                for s in batch:
                    assert s.read is not None
                    s.read.set_result(None)

