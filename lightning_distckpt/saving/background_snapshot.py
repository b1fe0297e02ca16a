"""The part of an async save's snapshot that its background thread takes (``background_snapshot``).

An async save normally copies every shard into its staging pool before ``save`` returns, so the
caller may change its tensors right away; that copy is the caller's whole wait once the plan is
cached. With ``background_snapshot`` the copy of the shards it selects is taken by the save's
background thread instead (CUDA shards on a stream of their own, overlapping the computation the
caller queues meanwhile), and the caller promises not to change them until the copy is done:
``AsyncSaveRequest.wait_snapshot()``. A training loop calls it before the optimizer step, the first
thing that changes parameters and optimizer state (forward and backward only read them); this is the
contract of DCP's ``async_save`` with asynchronous staging.

A promise broken is caught where torch can see it: each selected shard's version counter (bumped by
every in-place operation on the tensor or a view of it, not by writes through ``.data`` or torch's
fused optimizers), memory and shape (replaced by ``t.data = other``) are compared after its copy, and
a change fails the save on every rank (:class:`SaveFailedError`, naming the shards) instead of
committing a torn snapshot.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, List, Optional, Sequence, Tuple, Union

import torch

from ..core.errors import SaveFailedError
from ..storage.base import ShardWrite
from .async_staging import copy_in, ready_events

Placed = Tuple[ShardWrite, torch.Tensor]  # (the shard as written, pointing at its buffer; its source)
Selector = Union[bool, Callable[[torch.Tensor], bool]]


def _can_wait(t: torch.Tensor) -> bool:
    """A source whose copy may wait: on the CPU or CUDA, with a version counter (not an inference tensor)."""
    return t.device.type in ("cpu", "cuda") and not t.is_inference()


def _mark(t: torch.Tensor) -> Tuple[int, int, torch.Size]:
    """What a change of ``t`` after ``save`` alters: its version counter (in-place operations), and its
    memory and shape, which ``t.data = other`` replaces without counting a version: the copy would then
    read the other tensor's values, broadcast into the buffer where its shape differs."""
    return t._version, t.data_ptr(), t.shape


def split_snapshot(placed: Sequence[Placed], selector: Selector) -> Tuple[List[Placed], List[Placed]]:
    """(copied before ``save`` returns, copied in the background): ``selector`` is ``True`` for every
    shard, ``False`` for none, or a test of a shard's source tensor."""
    if selector is False:
        return list(placed), []
    now, later = [], []
    for w, data in placed:
        (later if _can_wait(data) and (selector is True or selector(data)) else now).append((w, data))
    return now, later


class BackgroundSnapshot:
    """The shards one save copies on its background thread; made on the caller's thread at ``save``."""

    def __init__(self, placed: Sequence[Placed], target: str) -> None:
        self._placed = list(placed)
        self._marks = [_mark(data) for _, data in self._placed]
        self._ready = ready_events([data for _, data in self._placed])  # CUDA: what is queued by now
        self._target = target
        self._done = threading.Event()
        self.nbytes = sum(w.data.numel() * w.data.element_size() for w, _ in self._placed)
        self.seconds = 0.0  # the background copy's

    def take(self) -> None:
        """On the background thread: copy, then check that no source changed meanwhile (raises
        :class:`SaveFailedError` naming them); the caller's :meth:`wait` returns either way."""
        t0 = time.perf_counter()
        try:
            copy_in(self._placed, self._ready)
            changed = [f"{w.key!r} (stored index {w.index})" for (w, data), m in zip(self._placed, self._marks)
                       if _mark(data) != m]
            if changed:
                raise SaveFailedError(
                    f"save to {self._target}: {len(changed)} tensor(s) changed in place while the background snapshot "
                    f"copied them: {', '.join(changed[:5])}{' ...' if len(changed) > 5 else ''}. "
                    "With background_snapshot "
                    "the state must not change until AsyncSaveRequest.wait_snapshot() returns "
                    "(a Lightning strategy waits "
                    "before the optimizer step: something else changed it earlier); nothing was committed")
        finally:
            self.seconds = time.perf_counter() - t0
            self._placed, self._ready = [], {}  # the sources are the caller's again
            self._done.set()

    def release(self) -> None:
        """The background thread ends without taking it (its save failed first): the caller waits no more."""
        self._placed, self._ready = [], {}
        self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: Optional[float] = None) -> bool:
        return self._done.wait(timeout)
