"""Moving the manifest's boxes from rank 0 to every rank, under a bound on bytes in flight.

Every rank walks the same list of broadcasts in the same order. A broadcast is posted with
``async_op=True`` and the loop goes on to prepare the next one (rank 0 copies the next boxes out
of the memory-mapped source; the others allocate receive buffers and cut the shards out of the
buffers that arrived) until the bytes of posted, unfinished broadcasts would pass
``max_inflight_bytes``; then it finishes the oldest. One box larger than the bound goes alone.

Data travels as raw bytes (uint8 views), so any dtype goes over any backend. A failure while
preparing data on rank 0 does not stop the broadcasts (the others would wait forever): it is
recorded, zeros are sent, and the caller agrees on the errors once everything has moved. So with a
buffer that cannot be allocated, on any rank (the caller tried the largest first, but shards and the
broadcasts in flight take memory meanwhile): it is allocated again once the broadcasts in flight are
finished; if even alone it cannot be, this rank's transfer fails (recorded, its shards dropped) and it
takes part in the remaining broadcasts with one spare buffer (:meth:`Transfer._spare`), so that every
rank raises at the end instead of waiting for it. A rank that cannot allocate even that spare, nor borrow
enough bytes (rank 0: the source tensor it sends; the others: a shard), closes its connections in the group
(``exchange_guard.left_alone``) and raises its failure: the others fail at once (CollectiveError), as they
would at the group's timeout. What remains: on other backends than gloo, they wait for that timeout.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Deque, Dict, List, Mapping, Optional, Sequence

import torch

from ..comm import Comm, Pending
from ..comm_bytes import backend_refs, settle
from ..core.errors import CheckpointingError, FormatError
from ..core.shown import quoted
from ..core.tensor_bytes import byte_view
from ..reading.exchange_guard import left_alone
from .plan import Manifest, Need, SendItem, SendOp, check_source_tensor, cut, describe_source



@dataclass
class TransferStats:
    """One rank's account of a transfer.

    ``peak_inflight_bytes``: the most bytes of posted, unfinished broadcasts at once;
    ``peak_extra_bytes``: the most bytes of buffers allocated for them at once (sends straight
    from the source and receives straight into a shard allocate none).
    """

    ops: int = 0
    bytes_moved: int = 0
    peak_inflight_bytes: int = 0
    peak_extra_bytes: int = 0
    seconds: float = 0.0


@dataclass
class _Posted:
    op: SendOp
    buffer: torch.Tensor
    work: Optional[Pending]  # None once waited for
    extra: int
    direct: Optional[str] = None  # name of the shard the buffer is (received straight into it)
    message: Optional[torch.Tensor] = None  # the bytes the backend was given (a view of ``buffer``)
    refs: Optional[int] = None  # references to ``message`` before its broadcast (comm_bytes.settle)


@dataclass
class Transfer:
    """This rank's part of moving ``manifest``'s boxes and cutting its shards.

    ``needs`` are this rank's needs, ``devices`` the device of each of its shards; ``source`` is
    rank 0's state dict (``None`` elsewhere). After :meth:`run`, ``shards`` maps names to
    materialized shards and ``errors`` lists what went wrong on this rank.
    """

    comm: Comm
    manifest: Manifest
    needs: Sequence[Need]
    devices: Mapping[str, torch.device]
    device: torch.device  # where communication buffers live
    max_inflight_bytes: int
    source: Optional[Mapping[str, Any]] = None
    shards: Dict[str, torch.Tensor] = field(default_factory=dict)
    errors: List[str] = field(default_factory=list)
    stats: TransferStats = field(default_factory=TransferStats)

    def __post_init__(self) -> None:
        self._by_key: Dict[str, List[Need]] = {}
        for n in self.needs:
            self._by_key.setdefault(n.key, []).append(n)
        self._inflight = 0
        self._extra = 0
        self._failed = False  # this rank's transfer failed: no shards are cut, messages use the spare
        self._spare_buffer: Optional[torch.Tensor] = None

    def run(self) -> None:
        """Move every box and cut this rank's shards. A failed broadcast (a rank died or timed out)
        raises :class:`CollectiveError` (from :class:`Comm`); other failures land in ``errors``."""
        t0 = time.perf_counter()
        pending: Deque[_Posted] = deque()
        done_keys = set()
        for op in self.manifest.ops:
            while pending and self._inflight + op.nbytes > self.max_inflight_bytes:
                self._finish(pending.popleft())
            pending.append(self._post(op, pending))
            if self.source is not None and not self._failed:  # rank 0 cuts its shards while the broadcast runs
                for item in op.items:
                    self._cut_local(item.key)
                    done_keys.add(item.key)
            while pending and pending[0].work.is_completed():
                self._finish(pending.popleft())
        while pending:
            self._finish(pending.popleft())
        if self.source is None:
            self._store_empty()
        elif not self._failed:
            for key in self._by_key:
                if key not in done_keys and key not in self.manifest.missing:
                    self._cut_local(key)
        self.stats.seconds = time.perf_counter() - t0

    def _store_empty(self) -> None:
        """Other ranks: a shard of no elements is in no broadcast (rank 0 sends only boxes that hold
        something), yet it is an entry of the result like any other (an empty tensor, or a rank's
        empty part of an uneven split): made here, of its shape, or the rank's state dict would lack it."""
        for key, needs in self._by_key.items():
            if key in self.manifest.missing:
                continue
            for n in needs:
                if n.name not in self.shards and n.numel == 0:
                    self._store(n, torch.empty(n.shape, dtype=n.dtype), n.offset)

    # -- one broadcast -----------------------------------------------------------------------
    def _post(self, op: SendOp, pending: Deque[_Posted]) -> _Posted:
        buffer, extra, direct = self._buffer(op, pending)
        self._inflight += op.nbytes
        self._extra += extra
        self.stats.peak_inflight_bytes = max(self.stats.peak_inflight_bytes, self._inflight)
        self.stats.peak_extra_bytes = max(self.stats.peak_extra_bytes, self._extra)
        message = byte_view(buffer)
        refs = backend_refs(message)
        work = self.comm.broadcast_tensor(message, 0)
        self.stats.ops += 1
        self.stats.bytes_moved += op.nbytes
        return _Posted(op, buffer, work, extra, direct, message, refs)

    def _buffer(self, op: SendOp, pending: Deque[_Posted]) -> "tuple[torch.Tensor, int, Optional[str]]":
        """The op's buffer: :meth:`_fill` (rank 0) or :meth:`_receive_buffer`. One that cannot be allocated
        is tried again once the broadcasts in flight are finished; alone, this rank's transfer fails."""
        while not self._failed:
            try:
                return (*self._fill(op), None) if self.source is not None else self._receive_buffer(op)
            except Exception as e:  # no memory (torch's OutOfMemoryError; on the CPU a RuntimeError)
                if pending:
                    self._finish(pending.popleft())
                    continue
                keys = ", ".join(repr(i.key) for i in op.items[:3]) + (" ..." if len(op.items) > 3 else "")
                self.errors.append(f"allocating {op.nbytes / 2**20:.1f} MiB on {self.device} for the broadcast of "
                                   f"{keys} failed: {type(e).__name__}: {str(e).strip().splitlines()[0][:300]}")
                self._failed = True
        return self._spare(op), 0, None

    def _fill(self, op: SendOp) -> "tuple[torch.Tensor, int]":
        """Rank 0: the buffer to send. One box that is already contiguous on the communication
        device is sent as it is (a view of the memory map); anything else is copied. The buffer's
        allocation may raise (:meth:`_buffer`); a failure to read the source is recorded."""
        assert self.source is not None
        try:
            views = [self._checked_source(item.key, item)[_slices(item.offset, item.shape)] for item in op.items]
        except Exception as e:  # reported on every rank once the broadcasts are through
            self._read_failed(op, e)
            return self._spare(op), 0
        if len(views) == 1 and views[0].is_contiguous() and views[0].device == self.device:
            return views[0], 0
        buffer = torch.empty(op.nbytes, dtype=torch.uint8, device=self.device)
        try:
            for item, view in zip(op.items, views):
                buffer[item.start:item.start + item.nbytes].view(item.dtype).view(item.shape).copy_(view)
        except Exception as e:  # the buffer goes as it is: reported on every rank once the broadcasts are through
            self._read_failed(op, e)
        return buffer, op.nbytes

    def _read_failed(self, op: SendOp, e: BaseException) -> None:
        self.errors.append(f"reading {', '.join(i.key for i in op.items)[:200]} from {self.manifest.source}: "
                           f"{type(e).__name__}: {e}")

    def _spare(self, op: SendOp) -> torch.Tensor:
        """What goes, or is received, once this rank's transfer failed (garbage: every rank raises at the
        end): one zeroed buffer, grown as needed; without memory for it, the bytes of the source tensor
        rank 0 sends, or of one of this rank's shards (dropped: the memory of the others is given back)."""
        spare = self._spare_buffer
        if spare is None or spare.numel() < op.nbytes:
            self._spare_buffer = spare = None
            own = list(self.shards.values())
            self.shards.clear()
            if self.source is not None:
                with contextlib.suppress(Exception):  # the source may fail to give it (recorded already)
                    own = [self.source[op.items[0].key]]
            usable = [byte_view(t) for t in own if t.device == self.device and t.is_contiguous()
                      and t.numel() * t.element_size() >= op.nbytes]
            borrowed = usable[0] if usable else None
            del own, usable  # the others' memory back
            try:
                spare = torch.zeros(op.nbytes, dtype=torch.uint8, device=self.device)
            except Exception as e:
                if borrowed is None:  # cannot take part: the others must not wait for this rank
                    spare_error = CheckpointingError(f"allocating a spare {op.nbytes / 2**20:.1f} MiB on "
                                                     f"{self.device} failed: {type(e).__name__}: {_first_line(e)}")
                    raise left_alone(self.comm, self.device, CheckpointingError("; ".join(self.errors[:3])),
                                     spare_error) from e
                spare = borrowed
            self._spare_buffer = spare
        return spare[:op.nbytes]

    def _receive_buffer(self, op: SendOp) -> "tuple[torch.Tensor, int, Optional[str]]":
        """Other ranks: receive straight into the shard when the box is exactly one shard of
        this rank, in the right dtype and on the communication device; else into a buffer."""
        if len(op.items) == 1:
            item = op.items[0]
            mine = self._by_key.get(item.key, [])
            if len(mine) == 1:
                n = mine[0]
                if ((n.offset, n.shape, n.flat, n.dtype) == (item.offset, item.shape, None, item.dtype)
                        and self.devices[n.name] == self.device):
                    shard = torch.empty(n.local_shape, dtype=n.dtype, device=self.device)
                    self.shards[n.name] = shard
                    return shard, 0, n.name
        return torch.empty(op.nbytes, dtype=torch.uint8, device=self.device), op.nbytes, None

    def _finish(self, posted: _Posted) -> None:
        work, posted.work = posted.work, None
        assert work is not None
        work.wait()
        # gloo's worker lets go of the message a moment after the wait: until it has, memory this rank frees
        # (a failed rank's shards, dropped for its spare buffer) is not given back, and a process ending then
        # may abort (comm_bytes). None left referenced here: then wait for the backend.
        del work
        settle(posted.message, posted.refs)
        posted.message = None
        if self.source is None and posted.direct is None and not self._failed:
            for item in posted.op.items:
                box = posted.buffer[item.start:item.start + item.nbytes].view(item.dtype).view(item.shape)
                for n in self._by_key.get(item.key, []):
                    self._store(n, box, item.offset)
        self._inflight -= posted.op.nbytes
        self._extra -= posted.extra

    # -- cutting shards ----------------------------------------------------------------------
    def _cut_local(self, key: str) -> None:
        """Rank 0: cut its own shards of ``key`` straight from the source."""
        assert self.source is not None
        try:
            tensor = self._checked_source(key)
            origin = (0,) * tensor.dim()
        except Exception as e:  # reported on every rank at the end; the broadcasts go on
            self.errors.append(f"reading {key!r} from {self.manifest.source}: {type(e).__name__}: {e}")
            return
        for n in self._by_key.get(key, []):
            self._store(n, tensor, origin)

    def _checked_source(self, key: str, item: Optional[SendItem] = None) -> torch.Tensor:
        """Rank 0's tensor ``key``, looked up again: still what the manifest was decided from. A mapping
        that reads its file at each lookup sees the file as it is now: a tensor grown or of another dtype
        made this broadcast's size differ from what the others receive (gloo aborts them), or cut shards
        from a tensor nobody checked."""
        assert self.source is not None
        tensor = self.source[key]
        check_source_tensor(self.source, key, tensor, self._by_key.get(key, []))
        if item is not None and (tuple(tensor.shape), tensor.dtype) != (item.global_shape, item.dtype):
            raise FormatError(f"{describe_source(self.source, key)}: {quoted(key)} changed after rank 0 checked it: "
                              f"{tuple(tensor.shape)} {tensor.dtype} now, {item.global_shape} {item.dtype} then "
                              "(the file rewritten while it was read?)")
        return tensor

    def _store(self, need: Need, box: torch.Tensor, origin: Sequence[int]) -> None:
        try:
            self.shards[need.name] = cut(need, box, origin, self.devices[need.name])
        except Exception as e:  # reported on every rank at the end
            self.errors.append(f"{need.name!r} (key {need.key!r}): {type(e).__name__}: {e}")


def _slices(offset: Sequence[int], shape: Sequence[int]) -> tuple:
    return tuple(slice(o, o + s) for o, s in zip(offset, shape))


def _first_line(e: BaseException) -> str:
    return str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
