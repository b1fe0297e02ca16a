"""Bytes between ranks over tensors this module owns until the backend has let go of them.

Why not torch's object collectives (``broadcast_object_list``, ``send_object_list``, ...): gloo's worker
thread holds a collective's tensors for a moment after the collective returns. When Python drops its last
reference first (a temporary inside torch's function), torch keeps the tensor's Python object alive for the
worker, whose release of it then needs the GIL; if that release falls into interpreter shutdown, Python ends
the worker thread inside C++ and the process aborts ("terminate called without an active exception",
pytorch/pytorch#179291): a program whose last act was a save or a load exits with SIGABRT after all its work
succeeded. Here every tensor handed to a CPU collective is kept until the backend's count of references to
it is back where it was (:func:`released`), so the worker's release never needs the GIL. Waiting for that
after every collective would cost a scheduling round trip each (twice a small collective's time on a busy
machine): a small tensor is kept instead (:class:`_Kept`) and let go once a later collective finds the
backend done with it, or at the latest at interpreter exit (``atexit``, while threads may still run).

Each message is a fixed head (the payload's size, then the payload itself when it fits in
:data:`SMALL_BYTES`) and, for a larger payload only, a second message of exactly its bytes.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from collections import deque
from typing import Any, Callable, Deque, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

#: Payloads up to this size travel in the head: one message (a save's handshakes are a few hundred bytes).
SMALL_BYTES = 1024
_SIZE = 8  # a size field: little-endian, unsigned
#: A bound on waiting for the backend to let go (the wait ends as soon as it has: microseconds); past it
#: the collective returns anyway, as it would without the wait.
_MAX_WAIT_S = 1.0


#: A tensor up to this size is kept after its collective (see above); a larger one is waited for at once
#: (a transfer's time dwarfs the wait), so what is kept stays small.
_KEEP_BYTES = 1 << 20
_KEEP_COUNT = 256  # past this many kept, the oldest is waited for


class _Kept:
    """Small tensors of completed collectives, each with the count of references it had before its collective:
    held until the backend is seen to have let go (then dropping it frees it here, with the GIL), or settled at
    exit. Collectives run from several threads (a background save's commit): one lock."""

    def __init__(self) -> None:
        self._items: Deque[Tuple[torch.Tensor, int]] = deque()
        self._lock = threading.Lock()
        self._hooked_pid: Optional[int] = None

    def add(self, items: Sequence[Tuple[torch.Tensor, int]]) -> None:
        with self._lock:
            kept = [(t, n) for t, n in self._items if t._use_count() > n]  # the rest are the backend's no more
            kept.extend(items)
            oldest, kept = kept[:max(0, len(kept) - _KEEP_COUNT)], kept[-_KEEP_COUNT:]
            self._items = deque(kept)
            if self._hooked_pid != os.getpid():  # once per process (a forked child inherits the flag only)
                self._hooked_pid = os.getpid()
                atexit.register(self.settle_all)
        for t, n in oldest:
            settle(t, n)

    def settle_all(self) -> None:
        with self._lock:
            items, self._items = list(self._items), deque()
        for t, n in items:
            settle(t, n)


_kept = _Kept()


def released(op: Callable[[], Any], tensors: Sequence[torch.Tensor]) -> Any:
    """Run ``op``, a blocking collective on ``tensors``, and return its result; each tensor is let go of only
    once the backend holds no more references to it than before (:func:`settle` for a large one, at once;
    a small one kept until then, see above)."""
    before = [backend_refs(t) for t in tensors]
    result = op()
    small: List[Tuple[torch.Tensor, int]] = []
    for t, count in zip(tensors, before):
        if count is None:
            continue
        if t.nbytes > _KEEP_BYTES:
            settle(t, count)
        elif t._use_count() > count:  # (most often the backend has let go already)
            small.append((t, count))
    if small:
        _kept.add(small)
    return result


def backend_refs(t: Optional[torch.Tensor]) -> Optional[int]:
    """How many references ``t``'s tensor has (torch's private count; None where it is not kept or where
    the wait is left to the backend: a collective on another device completes asynchronously)."""
    if t is None or t.device.type != "cpu" or not hasattr(t, "_use_count"):
        return None
    return t._use_count()


def settle(t: Optional[torch.Tensor], count: Optional[int]) -> None:
    """Wait until ``t`` has no more references than ``count`` (:func:`backend_refs` before its operations,
    all of which have completed and whose works the caller no longer holds): the backend has let go of it."""
    if count is None or t is None:
        return
    deadline = None
    while t._use_count() > count:
        now = time.monotonic()
        deadline = deadline or now + _MAX_WAIT_S
        if now > deadline:
            logger.warning("a collective's tensor (%d bytes) is still referenced %d times (%d before it) after %.1f s; "
                           "going on", t.nbytes, t._use_count(), count, _MAX_WAIT_S)
            return
        time.sleep(0)  # lets the worker run (and take the GIL, should it need it)


def _head(data: Optional[bytes], *sizes: int) -> bytearray:
    """A head: ``sizes`` (each :data:`_SIZE` bytes), then ``data`` when it fits."""
    head = bytearray(_SIZE * len(sizes) + SMALL_BYTES)
    for k, n in enumerate(sizes):
        head[k * _SIZE:(k + 1) * _SIZE] = n.to_bytes(_SIZE, "little")
    if data is not None and len(data) <= SMALL_BYTES:
        head[_SIZE * len(sizes):_SIZE * len(sizes) + len(data)] = data
    return head


def _size(head: bytes, k: int = 0) -> int:
    return int.from_bytes(head[k * _SIZE:(k + 1) * _SIZE], "little")


def _tensor(buf: bytearray, device: torch.device) -> torch.Tensor:
    t = torch.frombuffer(buf, dtype=torch.uint8) if len(buf) else torch.empty(0, dtype=torch.uint8)
    return t if device.type == "cpu" else t.to(device)


def _bytes(t: torch.Tensor, n: int, offset: int = 0) -> memoryview:
    """``n`` bytes of ``t`` from ``offset``, without a copy on the CPU."""
    return memoryview(t.cpu().numpy())[offset:offset + n]


def all_gather_bytes(group: Any, size: int, mine: bytearray, device: torch.device) -> List[memoryview]:
    """Every rank's ``mine`` (the same length on every rank), in rank order."""
    src = _tensor(mine, device)
    out = [torch.empty_like(src) for _ in range(size)]
    released(lambda: dist.all_gather(out, src, group=group), [src, *out])
    return [_bytes(t, len(mine)) for t in out]


def all_gather_tensor(group: Any, tensor: torch.Tensor) -> List[torch.Tensor]:
    """Every rank's ``tensor`` (contiguous, the same shape and dtype on every rank), in rank order: what
    ``torch.distributed.nn.functional.all_gather`` gives without autograd, its tensors kept until the backend
    has let go of them."""
    out = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    released(lambda: dist.all_gather(out, tensor, group=group), [tensor, *out])
    return out


def broadcast_bytes(group: Any, data: Optional[bytes], src: int, device: torch.device) -> memoryview:
    """``data`` of group rank ``src`` (the others pass None) on every rank."""
    head = _tensor(_head(data, len(data) if data is not None else 0), device)
    released(lambda: dist.broadcast(head, group_src=src, group=group), [head])
    n = _size(_bytes(head, _SIZE))
    if n <= SMALL_BYTES:
        return _bytes(head, n, _SIZE)
    body = _tensor(bytearray(data), device) if data is not None else torch.empty(n, dtype=torch.uint8, device=device)
    released(lambda: dist.broadcast(body, group_src=src, group=group), [body])
    return _bytes(body, n)


def send_bytes(group: Any, data: bytes, dst: int, device: torch.device) -> None:
    """Send ``data`` to group rank ``dst`` (which takes it with :func:`recv_bytes`)."""
    head = _tensor(_head(data, len(data)), device)
    released(lambda: dist.send(head, group_dst=dst, group=group), [head])
    if len(data) > SMALL_BYTES:
        body = _tensor(bytearray(data), device)
        released(lambda: dist.send(body, group_dst=dst, group=group), [body])


def recv_bytes(group: Any, src: int, device: torch.device) -> memoryview:
    """What group rank ``src`` sends with :func:`send_bytes`."""
    head = torch.empty(_SIZE + SMALL_BYTES, dtype=torch.uint8, device=device)
    released(lambda: dist.recv(head, group_src=src, group=group), [head])
    n = _size(_bytes(head, _SIZE))
    if n <= SMALL_BYTES:
        return _bytes(head, n, _SIZE)
    body = torch.empty(n, dtype=torch.uint8, device=device)
    released(lambda: dist.recv(body, group_src=src, group=group), [body])
    return _bytes(body, n)


def scatter_bytes(group: Any, rank: int, parts: Optional[Sequence[bytes]], src: int,
                  device: torch.device) -> memoryview:
    """Group rank ``src`` passes one payload per rank (the others None); each rank gets its own. A second
    message, padded to the largest payload, carries them when any is larger than :data:`SMALL_BYTES`."""
    largest = max(map(len, parts)) if parts is not None else 0
    heads = [_tensor(_head(p, len(p), largest), device) for p in parts] if rank == src and parts is not None else None
    head = torch.empty(2 * _SIZE + SMALL_BYTES, dtype=torch.uint8, device=device)
    released(lambda: dist.scatter(head, heads, group_src=src, group=group), [head, *(heads or [])])
    meta = _bytes(head, 2 * _SIZE)
    n, largest = _size(meta, 0), _size(meta, 1)
    if largest <= SMALL_BYTES:
        return _bytes(head, n, 2 * _SIZE)
    bodies = None
    if rank == src and parts is not None:
        bodies = [_tensor(bytearray(p) + bytearray(largest - len(p)), device) for p in parts]
    body = torch.empty(largest, dtype=torch.uint8, device=device)
    released(lambda: dist.scatter(body, bodies, group_src=src, group=group), [body, *(bodies or [])])
    return _bytes(body, n)
