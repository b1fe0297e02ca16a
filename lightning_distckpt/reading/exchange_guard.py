"""What keeps one rank's failure in a chunk exchange (:mod:`.exchange`) from leaving the others waiting.

The ranks of an exchange post their ops' broadcasts, sends and receives in one order; a rank that raised
between two of them would leave its partners waiting in the next one until the group's timeout, while the
failing rank alone raised. So:

* what can fail before the exchange fails there: this rank's destinations are allocated and its largest
  buffers tried (:func:`prepare`) before the exchange's gather of requests, which carries the outcome: the
  exchange is skipped on every rank of the group and the load fails on every rank, naming this one;
* in the exchange, a failure of this rank's own work (copying into or out of a buffer, into a destination)
  is recorded (:func:`stage_error`) and reported on every rank at the end, as a failed read is, while the
  op's communication still happens;
* a buffer that cannot be allocated while others are in flight is allocated again once they are done (the
  exchange's schedules); a thread that cannot be started (a pids limit, no room for its stack) leaves its
  work to the main thread (:func:`start_thread`);
* a buffer that cannot be allocated even alone, though it could be when tried (the memory taken meanwhile:
  the copies made for a chunk's further requests, another thread), fails the load: the failure is recorded,
  this rank's results are dropped and it takes part in its remaining ops with one spare buffer
  (:func:`take_part`), so every rank raises the failure at the end.

A rank that can then neither allocate that spare buffer nor borrow a destination's bytes large enough for a
message cannot take part: it closes its connections in the group (:meth:`Comm.close_connections`), as the
group's timeout would, and raises its failure; its partners fail at once with a CollectiveError (whose message
names the rank), not at the timeout. The group is left unusable, as a timeout leaves it. What remains: on other
backends than gloo (NCCL: a spare on the accelerator) nothing closes the connections, and the partners fail at
the group's timeout.
"""

from __future__ import annotations

import threading
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from ..core.errors import CheckpointingError
from ..comm import Comm
from ..core.tensor_bytes import byte_view
from ..planning.exchange_plan import BROADCAST, LOCAL, ChunkId, ExchangeOp
from .request import Requester


def cpu_direct(t: torch.Tensor) -> bool:
    """Reads land in ``t`` itself: a contiguous CPU tensor."""
    return t.device.type == "cpu" and t.is_contiguous()


def on_comm_device(t: torch.Tensor, device: torch.device) -> bool:
    """Messages go straight from or into ``t``: contiguous, on the communication device."""
    return t.device == device and t.is_contiguous()


def op_buffers(op: ExchangeOp, rank: int, dest: Dict[ChunkId, torch.Tensor], device: torch.device) -> int:
    """Bytes of buffers ``rank`` allocates for ``op`` (see ``ChunkExchange.admit``): read targets for
    destinations reads cannot land in; a message buffer for a bucket, or for a chunk not on ``device``."""
    extra = 0
    single = len(op.chunks) == 1
    if op.src == rank:
        extra += sum(n for c, n in zip(op.chunks, op.sizes) if not cpu_direct(dest[c]))
        if op.transport != LOCAL:
            if not single:
                extra += op.nbytes
            elif device.type != "cpu" and not on_comm_device(dest[op.chunks[0]], device):
                extra += op.nbytes
    elif not single or not on_comm_device(dest[op.chunks[0]], device):
        extra += op.nbytes
    return extra


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:300] if text else ''}"


def stage_error(what: str, keys: Iterable[str], e: BaseException) -> CheckpointingError:
    """This rank's failure at ``what`` for the chunks of ``keys``, as the error the load reports."""
    names = sorted(set(keys))
    shown = ", ".join(repr(k) for k in names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return CheckpointingError(f"{what} for {shown} failed: {_first_line(e)}")


def allocate(shape: Sequence[int], dtype: torch.dtype, device: torch.device, pin: bool, key: str) -> torch.Tensor:
    """``torch.empty``; a failure (no memory) as a CheckpointingError naming the bytes, device and key."""
    try:
        return torch.empty(tuple(shape), dtype=dtype, device=device, pin_memory=pin)
    except Exception as e:  # torch's OutOfMemoryError, a RuntimeError on the CPU ("can't allocate memory")
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        raise stage_error(f"allocating {nbytes / 2**20:.1f} MiB on {device}", [key], e) from e


def prepare(local: Dict[ChunkId, List[Requester]], device: torch.device,
            bucket_bytes: int) -> Tuple[Dict[ChunkId, torch.Tensor], Optional[BaseException]]:
    """This rank's destination of each chunk (its first requester's data, or a fresh CPU tensor), and the
    error that stops it from taking part in the exchange (None: it can)."""
    dest: Dict[ChunkId, torch.Tensor] = {}
    try:
        for c, requesters in local.items():
            st = requesters[0].tensor
            shape = (st.local_shape if st.flattened_range is None
                     else (st.flattened_range.stop - st.flattened_range.start,))
            # detach: parameters (keep_vars) are written in place, outside autograd
            dest[c] = (st.data.detach() if st.data is not None
                       else allocate(shape, st.dtype, torch.device("cpu"), False, st.key))
        _try_buffers(local, dest, device, bucket_bytes)
    except Exception as e:  # told to the group in the gather of requests, raised on every rank at the end
        return dest, e
    return dest, None


def _try_buffers(local: Dict[ChunkId, List[Requester]], dest: Dict[ChunkId, torch.Tensor], device: torch.device,
                 bucket_bytes: int) -> None:
    """Allocate, at once and then free, the most buffers any one op of this rank can need (see
    ``ChunkExchange.admit``): a read target for a destination reads cannot land in, a message buffer for one
    that is not on the communication device, a bucket's (at most ``bucket_bytes``) for small chunks. A rank
    that cannot hold even these fails here, before the exchange; one that can completes the exchange, each
    op alone if need be (the schedules)."""
    read = message = (0, "")
    small = ""
    for c, requesters in local.items():
        n = requesters[0].tensor.local_nbytes()
        if n < bucket_bytes:
            small = small or c[0]
            continue
        if not cpu_direct(dest[c]):
            read = max(read, (n, c[0]))
        if not on_comm_device(dest[c], device):
            message = max(message, (n, c[0]))
    cpu = torch.device("cpu")
    if device.type == "cpu":  # one chunk's message is its read target; a bucket's is a buffer of its own
        wanted = [max(read, message, (2 * bucket_bytes, small) if small else (0, "")) + (cpu,)]
    else:
        bucket = (bucket_bytes, small) if small else (0, "")
        wanted = [max(read, bucket) + (cpu,), max(message, bucket) + (device,)]
    # Host memory is tried unpinned: the pinned allocator would keep what it allocated for the rest of the run
    held = [allocate((n,), torch.uint8, dev, False, key) for n, key, dev in wanted if n]
    del held


def start_thread(target: Callable[[], None], name: str) -> Optional[threading.Thread]:
    """A started daemon thread running ``target``, or None when none can be started (``can't start new
    thread``): the caller then does the work itself."""
    thread = threading.Thread(target=target, name=name, daemon=True)
    try:
        thread.start()
    except RuntimeError:
        return None
    return thread


def take_part(comm: Comm, tags: Sequence[int], ops: Sequence[ExchangeOp], dest: Dict[ChunkId, torch.Tensor],
              device: torch.device, failure: Optional[BaseException]) -> None:
    """This rank's part in the communication of ``ops`` (in plan order, with their message tags) once its
    load has failed (``failure``): nothing is read or copied, each message goes from or into one spare buffer
    (garbage: every rank raises at the end), one op at a time (a valid schedule: each rank waits only for ops
    that every rank posts in the same order). The spare is allocated, or else borrowed from the destination of
    one of ``ops``' chunks (its values are lost anyway; a direct read's is left alone, being read into).
    Without either, this rank leaves the exchange: see :func:`left_alone`."""
    dest = {c: dest[c] for op in ops for c in op.chunks if c in dest}
    spare: Optional[torch.Tensor] = None
    for index, op in zip(tags, ops):
        if op.transport == LOCAL:
            continue
        if spare is None or spare.numel() < op.nbytes:
            spare = None  # freed before a larger one is tried
            try:
                spare = _spare(op, dest, device)
            except Exception as e:  # no memory even for the spare
                raise left_alone(comm, device, failure, stage_error(
                    f"allocating a spare {op.nbytes / 2**20:.1f} MiB on {device}", (c[0] for c in op.chunks), e)) from e
        message = spare[:op.nbytes]
        if op.transport == BROADCAST:
            works = [comm.broadcast_tensor(message, op.src)]
        elif op.src == comm.rank:
            works = [comm.isend(message, r, tag=index) for r in op.receivers]
        else:
            works = [comm.irecv(message, op.src, tag=index)]
        for w in works:
            w.wait()


def _spare(op: ExchangeOp, dest: Dict[ChunkId, torch.Tensor], device: torch.device) -> torch.Tensor:
    try:
        return torch.empty(op.nbytes, dtype=torch.uint8, device=device)
    except Exception:  # no memory: the bytes of the largest destination that can hold the message
        own = (byte_view(d) for d in dest.values() if on_comm_device(d, device))
        largest = max(own, key=lambda t: t.numel(), default=None)
        if largest is None or largest.numel() < op.nbytes:
            raise
        return largest


def left_alone(comm: Comm, device: torch.device, failure: Optional[BaseException],
               spare: BaseException) -> CheckpointingError:
    """The error of a rank whose part failed (``failure``) and that cannot take part in its remaining messages
    (``spare``: no buffer for them), once it closed its connections in the group so that its partners fail now
    (:meth:`Comm.close_connections`) rather than wait for it until the group's timeout."""
    closed = comm.close_connections(device)
    then = ("closed its connections in the group so that the other ranks fail now, not at its timeout (the group "
            "is no longer usable)" if closed else "left the exchange: the other ranks fail at the group's timeout")
    return CheckpointingError(f"rank {comm.rank}: {failure}; then, without memory to take part in its remaining "
                              f"messages ({spare}), it {then}")
