"""Background snapshots in a Trainer fit (``background_snapshot: true`` with ``async_save``).

A background save's snapshot is normally the caller's whole wait: the state is copied into host
memory before ``trainer.save_checkpoint`` returns. With ``background_snapshot`` the parameters and the
optimizer state (the bulk of a checkpoint) are copied by the save's own thread instead, while the
training goes on: the forward and backward passes of the next step only read them (CUDA copies run
on a stream of their own, overlapping the step's kernels). Everything else (buffers, which a forward
may update, and the common state) is copied before the save returns, as without it.

Where the strategy waits for the copy (``AsyncSaveRequest.wait_snapshot``), before anything may
change what it copies:

* the next optimizer step, after its closure (forward and backward) for torch's own optimizers,
  which call the closure before changing anything; before the step for any other optimizer;
* :class:`SnapshotFence`, a callback placed first in the Trainer's list, at every hook outside the
  span of the training steps (epoch ends and starts, validation, test, predict, the end of training,
  an exception), so that a callback changing weights there (e.g. a weight-averaging callback
  swapping them in for validation) finds the copy done;
* the next save, load or teardown (they finalize the save).

Fabric's strategies (:class:`FabricBackgroundSnapshotMixin`) wait before the next ``optimizer.step()``
and at the next save, load or teardown; the rest of a Fabric loop is the caller's own code.

Code of one's own that changes parameters or optimizer state in place between a save and the next
optimizer step (in a batch hook or the forward) breaks the promise: the version counters catch most
such changes and fail that save on every rank, nothing committed (:mod:`..saving.background_snapshot`).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterable, Mapping, Optional, Set

import torch
from lightning.pytorch.callbacks import Callback
from torch.optim import Optimizer

from ..saving.async_save import AsyncSaveRequest
from ..saving.background_snapshot import Selector


def _storage(t: torch.Tensor) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t  # a DTensor: its shard on this rank
    return local.untyped_storage().data_ptr()


def parameters_and_optimizer_state(modules: Iterable[torch.nn.Module], optimizers: Iterable[Optimizer]) -> Selector:
    """A ``background_snapshot`` test: whether a shard's source lies in the memory of one of the
    modules' parameters or of the optimizers' state tensors (the state a step changes)."""
    storages: Set[int] = {_storage(p) for m in modules for p in m.parameters()}
    storages |= {_storage(v) for o in optimizers for st in o.state.values() for v in st.values()
                 if isinstance(v, torch.Tensor)}
    storages.discard(0)  # empty tensors share no memory
    return lambda t: _storage(t) in storages


def _calls_closure_first(optimizer: Optimizer) -> bool:
    """torch's own optimizers run the closure before they change anything."""
    return type(optimizer).__module__.startswith("torch.optim")


def wait_for_snapshot(strategy: Any) -> None:
    """Wait for the pending save's background copy, if any; the seconds waited add up in the
    strategy's ``snapshot_wait_s`` (what the training thread paid for the copy after all)."""
    pending: Optional[AsyncSaveRequest] = getattr(strategy.checkpoint_io, "pending", None)
    if pending is None or pending.snapshot_done():
        return
    t0 = time.perf_counter()
    pending.wait_snapshot()
    strategy.snapshot_wait_s = getattr(strategy, "snapshot_wait_s", 0.0) + time.perf_counter() - t0


#: The Trainer hooks outside the span of the training steps, where a callback may change weights.
FENCED_HOOKS = ("on_train_epoch_start", "on_train_epoch_end", "on_validation_start", "on_test_start",
                "on_predict_start", "on_train_end", "on_exception")


def _fence(name: str) -> Callable[..., None]:
    def hook(self: Callback, trainer: Any, *args: Any) -> None:  # (pl_module[, exception])
        wait_for_snapshot(trainer.strategy)
    hook.__name__ = hook.__qualname__ = name
    return hook


class SnapshotFence(Callback):
    """Waits for a background snapshot at each of :data:`FENCED_HOOKS` (see the module docstring).
    Kept first in the Trainer's callbacks by the strategy; holds no state."""


for _name in FENCED_HOOKS:
    setattr(SnapshotFence, _name, _fence(_name))


class BackgroundSnapshotMixin:
    """Trainer-strategy part (mixed in before Lightning's strategy class): which shards a background
    save leaves to its thread, and the waits. The strategy provides ``checkpoint_io`` (a
    ``DistCheckpointIO``), ``lightning_module`` and ``_raw_optimizers()``."""

    snapshot_wait_s = 0.0  # seconds the training thread waited for background copies (this process)

    def snapshot_selector(self) -> Selector:
        """What the next save may copy in the background: False unless ``background_snapshot`` is on."""
        io = self.checkpoint_io  # type: ignore[attr-defined]
        module = self.lightning_module  # type: ignore[attr-defined]
        # (the config refuses background_snapshot without async_save; background_saves: a save made now
        # commits before returning, and its copy is made before it does)
        if not (io.config.background_snapshot and io.background_saves) or module is None:
            return False
        return parameters_and_optimizer_state([module], self._raw_optimizers())  # type: ignore[attr-defined]

    def on_train_start(self) -> None:
        super().on_train_start()  # type: ignore[misc]
        module = self.lightning_module  # type: ignore[attr-defined]
        if self.checkpoint_io.config.background_snapshot and module is not None:  # type: ignore[attr-defined]
            callbacks = module.trainer.callbacks
            if not any(isinstance(c, SnapshotFence) for c in callbacks):
                callbacks.insert(0, SnapshotFence())

    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model: Any = None,
                       **kwargs: Any) -> Any:
        """Waits for a background snapshot before the step changes what it copies."""
        pending: Optional[AsyncSaveRequest] = self.checkpoint_io.pending  # type: ignore[attr-defined]
        if pending is None or pending.snapshot_done():
            return super().optimizer_step(optimizer, closure, model, **kwargs)  # type: ignore[misc]
        if callable(closure) and _calls_closure_first(optimizer):
            def fenced() -> Any:  # the forward and backward overlap the copy
                try:
                    return closure()
                finally:
                    wait_for_snapshot(self)
            return super().optimizer_step(optimizer, fenced, model, **kwargs)  # type: ignore[misc]
        wait_for_snapshot(self)
        return super().optimizer_step(optimizer, closure, model, **kwargs)  # type: ignore[misc]


class FabricBackgroundSnapshotMixin:
    """The Fabric strategies' part (mixed in before Fabric's strategy class). Fabric's loop is the
    caller's: the strategy waits for a background copy before the next ``optimizer.step()`` of an
    optimizer set up by Fabric (the forward and backward before it overlap the copy), and the next
    save, load or teardown waits as always. Anything else that changes the saved modules' parameters
    or the optimizers' state in place before that step must call
    ``fabric.strategy.checkpoint_io.pending.wait_snapshot()`` first."""

    def snapshot_selector_for(self, state: Mapping[str, Any]) -> Selector:
        """What a save of ``state`` may copy in the background: the memory of its modules'
        parameters and optimizers' state; False unless ``background_snapshot`` is on."""
        io = self.checkpoint_io  # type: ignore[attr-defined]
        if not (io.config.background_snapshot and io.background_saves):
            return False
        modules = [getattr(m, "module", m) for m in state.values() if isinstance(m, torch.nn.Module)]
        return parameters_and_optimizer_state(modules, [o for o in state.values() if isinstance(o, Optimizer)])

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        wait_for_snapshot(self)
        return super().optimizer_step(optimizer, **kwargs)  # type: ignore[misc]
