"""Checkpoint tiers for Trainer runs: a node-local checkpoint every ``local_every_n_steps`` optimizer
steps (:class:`~lightning_distckpt.tiers.LocalTier`, with partner copies on other nodes), the durable
checkpoints as today, and ``fit(ckpt_path="last")`` resuming from the newest step any tier can restore.

How it plugs into Lightning (no patching; docs/tiers.md):

* :class:`TierCheckpoint` is a ``ModelCheckpoint`` (the durable tier: ``last.ckpt`` every
  ``durable_every_n_steps``, or nothing of its own when that is unset and the Trainer's other
  ``ModelCheckpoint`` decides) that also saves the local tier from ``on_train_batch_end``: the dict
  ``trainer.save_checkpoint`` builds (``dump_checkpoint``), in the sharded form the strategy saves.
* ``DistCheckpointStrategy`` with ``tiers:`` configured adds one to the Trainer's callbacks when it
  launches (its launcher is Lightning's own with :class:`_TierLaunch` mixed in), before Lightning
  resolves ``ckpt_path``.
* Lightning resolves ``"last"`` on each rank alone (before any process group exists) as the newest
  of what every ``ModelCheckpoint._find_last_checkpoints`` names. Once a local save has happened,
  this callback names a marker file in its folder (shared storage, the same on every rank), made
  the newest; the strategy's ``load_checkpoint`` of the marker asks the tiers, collectively, for the
  newest recoverable step (:mod:`.tiers_restore`).
"""

from __future__ import annotations

import json
import logging
import os
import uuid
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies.launchers.launcher import _Launcher
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.trainer.states import TrainerFn

from ..core.errors import ArgumentTypeError, CheckpointingError
from ..tiers import LocalTier, TierOptions
from .model_checkpoint import DistModelCheckpoint
from .sharded import tree_or_failing
from .tiers_marker import (MARKER_NAME, _marker_folder, _read_marker, _run_of, _touch_marker, is_s3, remove_marker,
                           resumes_run)

log = logging.getLogger(__name__)



def is_tier_marker(path: Any) -> bool:
    """Whether ``path`` (what Lightning resolved ``ckpt_path`` to) is a tiers marker."""
    return isinstance(path, (str, os.PathLike)) and os.path.basename(os.fspath(path)) == MARKER_NAME


class TierCheckpoint(DistModelCheckpoint):
    """Saves the node-local tier every ``options.local_every_n_steps`` optimizer steps; as a
    ``ModelCheckpoint``, saves ``last.ckpt`` every ``options.durable_every_n_steps`` (unset: no
    durable saves of its own). ``DistCheckpointStrategy`` adds one when its config has ``tiers:``;
    pass one yourself to choose its ``dirpath`` or other ``ModelCheckpoint`` arguments.

    Args:
        options: the tiers' settings.
        kwargs: ``ModelCheckpoint``'s arguments (default: ``save_top_k=0``, and ``save_last=True``
            with ``every_n_train_steps=durable_every_n_steps`` when that is set).
    """

    def __init__(self, options: TierOptions, **kwargs: Any) -> None:
        if not isinstance(options, TierOptions):
            raise ArgumentTypeError(f"TierCheckpoint needs TierOptions, got {type(options).__name__}")
        durable = options.durable_every_n_steps
        defaults = dict(save_top_k=0, save_last=durable is not None, every_n_train_steps=durable or 0,
                        every_n_epochs=0)
        super().__init__(**{**defaults, **kwargs})
        self.options = options
        self.local_tier: Optional[LocalTier] = None
        self._last_local_step = -1
        self._marker_run = False  # the tier's run is the one setup found in the marker
        self._marker_seen = False  # the marker exists (this process wrote or found it): no look per local save
        self._staging_reserved = True  # on_train_start clears it: the snapshot memory is reserved once per fit

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["local_tier"] = None  # threads and a process group stay with this process
        return state

    # -- the local tier ----------------------------------------------------------------------
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        """ModelCheckpoint's setup, then this rank's LocalTier (collective: every rank sets up)."""
        super().setup(trainer, pl_module, stage)
        if not callable(getattr(trainer.strategy, "sharded_checkpoint", None)):
            raise CheckpointingError(f"TierCheckpoint needs DistCheckpointStrategy (the local tier holds its sharded "
                                     f"checkpoints), got {type(trainer.strategy).__name__}")
        if self.local_tier is None:
            run, self._marker_run = _rank0_agreed(trainer, lambda: self._run(trainer))
            self.local_tier = LocalTier(self.options, run=run)

    def _run(self, trainer: Any) -> Tuple[Optional[str], bool]:
        """The run this Trainer continues (:class:`LocalTier`'s ``run``): the marker's; a new one without a
        marker; None (any step, as before runs were recorded) for a marker written without one. With it,
        whether it is the marker's (a fit that then does not resume from the marker starts a new run)."""
        marker = self.marker_path(trainer)
        data = _read_marker(marker) if marker is not None else None
        return (uuid.uuid4().hex, False) if data is None else (_run_of(data), True)

    def _start_new_run(self, trainer: Any) -> None:
        """Collective, as a fit trains: one that did not resume from the marker (a fresh start, an explicit
        checkpoint) is a new run even where the marker names one (an earlier job's, given this folder): its
        saves never count as that run's, nor that run's steps as its own. The marker goes (rank 0; its first
        local save writes its own), so ``ckpt_path="last"`` never resumes the earlier run's steps."""
        marker = self.marker_path(trainer)
        if self.local_tier is None or not self._marker_run or marker is None:
            return
        # rank 0's view: Lightning resolved ckpt_path on each rank alone, and the branches below are collective
        if _rank0_agreed(trainer, lambda: resumes_run(trainer.ckpt_path, marker)):
            self._marker_run = False  # the run is this job's own now: a later fit of this Trainer continues it
            return
        old, run = self.local_tier.run, _rank0_agreed(trainer, lambda: uuid.uuid4().hex)
        self.local_tier.start_run(run)
        self._marker_run, self._marker_seen = False, False
        if _rank0_agreed(trainer, lambda: remove_marker(marker, old)):
            log.warning("tiers: this fit does not resume from %s (ckpt_path=%r): it starts a new run, and the local "
                        "steps of run %s in %s are not resumed; the marker is removed (its first local save writes "
                        "this run's). Give each job its own checkpoint folder and local_dir", marker,
                        trainer.ckpt_path, old, self.options.local_dir)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        """The step training starts (or resumes) from needs no local save: with gradient accumulation,
        the batches before the next optimizer step end at that same global step."""
        super().on_train_start(trainer, pl_module)
        self._last_local_step = trainer.global_step
        self._staging_reserved = False
        if not self._skip(trainer):
            self._start_new_run(trainer)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        """Ahead of a local save: its room made as the step starts (:meth:`_begin_local`); once per fit,
        when the optimizers hold state (their moments allocated: the estimate covers them), the local
        tier's snapshot memory allocated and faulted in on a thread of its own (as the strategy does for
        its durable saves): the first local save only copies."""
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
        if self.local_tier is None:
            return
        self._begin_local(trainer)
        if self._staging_reserved:
            return
        strategy = trainer.strategy
        raw = getattr(strategy, "_raw_optimizers", None)  # Lightning's wrappers removed
        optimizers = raw() if callable(raw) else list(strategy.optimizers)
        if not any(o.state for o in optimizers):
            return
        self._staging_reserved = True
        estimate = getattr(strategy, "_staged_bytes_estimate", None)
        if callable(estimate) and not self._skip(trainer):
            nbytes, on_accelerator = estimate()
            self.local_tier.reserve_staging(nbytes, on_accelerator)

    def _begin_local(self, trainer: Any) -> None:
        """As the batch whose step may make a local save due starts: the node's oldest local step goes now
        (``LocalTier.begin``, a helper thread), while the step trains."""
        step = trainer.global_step + 1
        if step % self.options.local_every_n_steps == 0 and step != self._last_local_step and not self._skip(trainer):
            assert self.local_tier is not None
            self.local_tier.begin(step)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        """The durable save when due (ModelCheckpoint's), then the local one when due."""
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        step = trainer.global_step
        if step % self.options.local_every_n_steps or step == self._last_local_step or self._skip(trainer):
            return
        self.save_local(trainer, step)

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        """With no per-epoch saves (``every_n_epochs=0``, the default here), none: ``ModelCheckpoint``
        would save ``last.ckpt`` at every epoch end; the durable tier saves every N steps only."""
        if self._every_n_epochs:
            super().on_train_epoch_end(trainer, pl_module)

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        """As :meth:`on_train_epoch_end`, for the ``last.ckpt`` ``ModelCheckpoint`` saves after validation."""
        if self._every_n_epochs:
            super().on_validation_end(trainer, pl_module)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        """The end of training waits for the last local save and its partner copies (collective);
        ``ModelCheckpoint``'s save of a ``last.ckpt`` at the end only with per-epoch saves (as above)."""
        if self._every_n_epochs:
            super().on_train_end(trainer, pl_module)
        if self.local_tier is not None:
            self.local_tier.wait()

    @staticmethod
    def _skip(trainer: Any) -> bool:
        return bool(trainer.fast_dev_run) or trainer.state.fn != TrainerFn.FITTING or trainer.sanity_checking

    def save_local(self, trainer: Any, step: int) -> None:
        """Collective: the checkpoint ``trainer.save_checkpoint`` would write, handed to the local tier as
        ``step`` (which returns once it has its snapshot)."""
        assert self.local_tier is not None, "TierCheckpoint.setup makes the local tier"
        self.local_tier.begin(step)  # begun as the step started (see _begin_local); else now, while the tree is built
        self.local_tier.save(self.local_tree(trainer, step), step=step)
        self._last_local_step = step
        if not self._marker_seen:  # once per fit; a failure raised on every rank, none left in the next collective
            _rank0_agreed(trainer, lambda: self._write_marker(trainer, step))
            self._marker_seen = True

    def local_tree(self, trainer: Any, step: int) -> Dict[str, Any]:
        """``trainer``'s checkpoint dict at ``step`` in the sharded form the strategy saves. Where
        the strategy builds it locally (``checkpoint_tree``: both of ours), a rank that cannot gets a tree
        whose description re-raises its error (:func:`~.sharded.failing_tree`): the local save's handshake
        raises it on every rank, one collective round fewer than an agreement of its own; elsewhere
        collective."""
        strategy = trainer.strategy
        build = getattr(strategy, "checkpoint_tree", None)
        if not callable(build):
            checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
            return strategy.sharded_checkpoint(checkpoint, f"local tier step {step}")
        # a failure is agreed by LocalTier.save's handshake, before anything is written
        return tree_or_failing(lambda: build(trainer._checkpoint_connector.dump_checkpoint(weights_only=False)))

    # -- ckpt_path="last" ----------------------------------------------------------------------
    def marker_path(self, trainer: Any) -> Optional[str]:
        """Where ``trainer``'s marker is: this callback's folder, a directory or ``s3://`` prefix (None: none)."""
        dirpath = str(self.dirpath) if self.dirpath is not None else self._default_dir(trainer)
        if dirpath is None:
            return None
        return f"{dirpath.rstrip('/')}/{MARKER_NAME}" if is_s3(dirpath) else os.path.join(dirpath, MARKER_NAME)

    def _write_marker(self, trainer: Any, step: int) -> None:
        """Rank 0: the marker, unless this callback already saw it."""
        marker = self.marker_path(trainer)
        if marker is None or self._marker_seen:
            return
        run = self.local_tier.run if self.local_tier is not None else None  # whose local steps "last" resumes
        data = json.dumps({"what": "lightning_distckpt tiers: local saves were made; ckpt_path='last' asks the tiers",
                           "local_dir": self.options.local_dir, "first_local_step": step,
                           **({"run": run} if run else {})}).encode()
        found = _read_marker(marker)
        if found is not None:  # written since setup read none: by another job saving to this folder
            if run is not None and _run_of(found) != run:
                log.warning("tiers: %s names another run than this Trainer's (another job saving to this folder "
                               "since this one started): ckpt_path='last' will not resume this run's local steps; "
                               "give each job its own checkpoint folder", marker)
        elif is_s3(marker):
            _marker_folder(marker).write(MARKER_NAME, data)
        else:
            os.makedirs(os.path.dirname(marker), exist_ok=True)
            tmp = f"{marker}.tmp{os.getpid()}"
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, marker)
        self._marker_seen = True

    def _find_last_checkpoints(self, trainer: Any) -> Set[str]:
        """The marker once local saves were made here, else the durable ``last*.ckpt`` found. Loading the
        marker asks the tiers, every durable ``last*.ckpt`` included (:func:`durable_candidates`), so ours are
        not offered beside it (S3 keeps whole seconds: a tie by modification time). The marker is made the
        newest (its time set to now; on S3 written again) against other callbacks' candidates."""
        marker = self.marker_path(trainer)
        if marker is not None and _touch_marker(marker):
            return {marker}
        return self.durable_last_checkpoints(trainer)

    def durable_last_checkpoints(self, trainer: Any) -> Set[str]:
        """This callback's own ``last*.ckpt`` for ``trainer`` (DistModelCheckpoint's lookup)."""
        return set(super()._find_last_checkpoints(trainer))


def _rank0_agreed(trainer: Any, what: Callable[[], Any]) -> Any:
    """Collective: ``what()`` run by rank 0 (an S3 request on the marker), its value on every rank; what failed
    raised on every rank (alone on rank 0, the others would wait for it in their next collective)."""
    found: Tuple[Any, Optional[str]] = (None, None)
    if trainer.is_global_zero:
        try:
            found = (what(), None)
        except (OSError, CheckpointingError) as e:
            found = (None, f"{type(e).__name__}: {e}" if isinstance(e, OSError) else str(e))
    value, error = trainer.strategy.broadcast(found, src=0)
    if error is not None:
        raise CheckpointingError(f"tiers: {error}")
    return value


def tier_callback(trainer: Any) -> Optional[TierCheckpoint]:
    """The Trainer's TierCheckpoint (the first, if several)."""
    return next((cb for cb in trainer.callbacks if isinstance(cb, TierCheckpoint)), None)


def durable_candidates(trainer: Any, read_step: Callable[[str], Optional[int]]) -> List[Tuple[int, str]]:
    """``(global step, path)`` of each durable ``last*.ckpt`` the Trainer's ``ModelCheckpoint``\\ s find,
    newest step first; ``read_step`` reads a checkpoint's step (None: not one this strategy resumes)."""
    paths: Set[str] = set()
    for cb in trainer.checkpoint_callbacks:
        if isinstance(cb, TierCheckpoint):
            paths |= cb.durable_last_checkpoints(trainer)
        elif isinstance(cb, ModelCheckpoint):
            paths |= {p for p in cb._find_last_checkpoints(trainer) if not is_tier_marker(p)}
    out = []
    for path in sorted(paths):
        step = read_step(path)
        if step is not None:
            out.append((step, path))
    return sorted(out, reverse=True)


def add_tier_callback(trainer: Any, options: TierOptions) -> None:
    """A :class:`TierCheckpoint` of ``options`` in the Trainer's callbacks, unless it has one."""
    if trainer is not None and tier_callback(trainer) is None:
        trainer.callbacks.append(TierCheckpoint(options))


class _TierLaunch:
    """A launcher that adds a :class:`TierCheckpoint` to the Trainer's callbacks (unless it has one)
    before the Trainer function runs: before Lightning resolves ``ckpt_path="last"``, and before a
    spawn launcher copies the Trainer to its processes. Mixed into Lightning's own launchers, so
    what Lightning does by their type (a subprocess launcher's kill on Ctrl-C) stays."""

    tier_options: TierOptions

    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        add_tier_callback(trainer, self.tier_options)
        return super().launch(function, *args, trainer=trainer, **kwargs)  # type: ignore[misc]


class TierSubprocessScriptLauncher(_TierLaunch, _SubprocessScriptLauncher):
    """``_SubprocessScriptLauncher`` (``strategy="ddp_distckpt"``) adding a :class:`TierCheckpoint`."""


class TierMultiProcessingLauncher(_TierLaunch, _MultiProcessingLauncher):
    """``_MultiProcessingLauncher`` (``"ddp_distckpt_spawn"``) adding a :class:`TierCheckpoint`."""


class TierDirectLauncher(_Launcher):
    """Where the strategy has no launcher (Lightning's ``ModelParallelStrategy`` in processes started
    by Lightning's launcher, ``torchrun`` or SLURM): the Trainer function called in this process, as
    Lightning calls it without a launcher, once a :class:`TierCheckpoint` is added."""

    def __init__(self, options: TierOptions) -> None:
        self.tier_options = options

    @property
    def is_interactive_compatible(self) -> bool:
        return True

    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        add_tier_callback(trainer, self.tier_options)
        return function(*args, **kwargs)

    def kill(self, signum: Any) -> None:
        """No processes of its own to kill."""


_TIER_LAUNCHERS = {_SubprocessScriptLauncher: TierSubprocessScriptLauncher,
                   _MultiProcessingLauncher: TierMultiProcessingLauncher}


def with_tier_callback(launcher: Optional[_Launcher], options: TierOptions) -> _Launcher:
    """``launcher`` (as the strategy configured it; None: none) as the same launcher that also adds a
    :class:`TierCheckpoint` of ``options`` to the Trainer before launching."""
    if launcher is None:
        return TierDirectLauncher(options)
    cls = _TIER_LAUNCHERS.get(type(launcher))
    if cls is None:
        raise CheckpointingError(f"tiers: the strategy's launcher {type(launcher).__name__} is not one this layer "
                                 f"extends ({[c.__name__ for c in _TIER_LAUNCHERS]}); pass a TierCheckpoint in "
                                 "the Trainer's callbacks instead of configuring tiers: in the strategy")
    out = cls.__new__(cls)
    out.__dict__.update(launcher.__dict__)
    out.tier_options = options
    return out
