"""``DistCheckpointStrategy``: Lightning's DDP with TP x DP process groups and distributed checkpoints.

Every rank takes part in saving and loading. The LightningModule describes its tensors with
``sharded_state_dict(self, prefix="")`` (tensor-parallel layers return ShardedTensors wrapping their
parameters); the optimizer state follows its parameters' sharding; the rest of the trainer state
(loops, callbacks, LR schedulers, hyper-parameters) is common state written once.
"""

from __future__ import annotations

import logging
from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

from ..comm import get_comm
from ..core.errors import CheckpointingError
from ..storage.paths import checkpoint_location
from .async_warmup import AsyncWarmupMixin, staged_share
from .checkpoint_io import lightning_not_found
from .collectives import TrainerCollectivesMixin
from .parallel import STRATEGY_NAME, ParallelState
from .sharded import (AFTER_READING, all_whole, build_on_all_ranks, main_replicas_of_buffers,
                      model_sharded_state_dict, optimizer_sharded_state, replicated_state_dict, restore_optimizer,
                      tree_or_failing)
from .snapshot_fence import BackgroundSnapshotMixin
from .tp_strategy import AsyncCommitHooksMixin, SavedTogetherMixin, TensorParallelStrategyMixin
from .tiers import is_tier_marker, with_tier_callback
from .tiers_restore import DeferredTierOptimizerStates, load_recovery_point
from .trainer_restore import DeferredOptimizerStates, load_before_setup, restore_after_setup
from .unused_weights import refusing_placeholders
from .tree import KIND_SHARDED, MANIFEST_KEY, manifest, rank_zero_tensors

log = logging.getLogger(__name__)


def warn_async_link_last(trainer: Any) -> None:
    """ModelCheckpoint(save_last="link") points last.ckpt at a checkpoint as soon as its save is
    issued. An async save commits later; a job that dies in between leaves a dangling link, and
    Lightning's ckpt_path="last" skips it and starts from scratch (with only a warning)."""
    if any(getattr(cb, "save_last", None) == "link" for cb in trainer.checkpoint_callbacks) and trainer.is_global_zero:
        log.warning(
            'ModelCheckpoint(save_last="link") with async saves: last.ckpt links to each checkpoint before its '
            'save commits; if the job dies in between, ckpt_path="last" finds no checkpoint and training restarts '
            'from scratch. Use save_last=True (last.ckpt is then a checkpoint of its own, replaced atomically).'
        )


def optimizer_prefix(index: int) -> str:
    return f"optimizer_states.{index}"


class DistCheckpointStrategy(TrainerCollectivesMixin, SavedTogetherMixin, AsyncWarmupMixin, BackgroundSnapshotMixin,
                             AsyncCommitHooksMixin, TensorParallelStrategyMixin, DDPStrategy):
    """DDP over the data-parallel group of a TP x DP grid, saving distributed checkpoints.

    ``Trainer(strategy=DistCheckpointStrategy(tensor_parallel_size=2), devices=4)`` runs TP 2 x DP 2;
    ``Trainer(strategy="ddp_distckpt")`` is the same with ``tensor_parallel_size=1``.

    * The process groups are built when the strategy sets up its environment, before
      ``LightningModule.configure_model``: build tensor-parallel layers there from
      :attr:`parallel_state` (or :func:`~lightning_distckpt.lightning.parallel.parallel_state_of`).
    * The module is wrapped in DDP over the DP group only: TP shards' gradients are not averaged across
      TP ranks, and DDP's initial broadcast only reaches ranks holding the same shard.
    * Dataloaders get a distributed sampler over the DP group (TP ranks see the same data).
    * Checkpoints: every rank saves and loads its own shards; restore happens after setup.

    Args:
        tensor_parallel_size: TP ranks per model replica (must divide the world size).
        checkpoint: checkpoint settings (:class:`DistCheckpointConfig`, mapping, or YAML path); a
            ``DistCheckpointIO`` plugin given to the Trainer takes precedence.
        Other arguments: as :class:`~lightning.pytorch.strategies.DDPStrategy` (see
            :class:`~lightning_distckpt.lightning.tp_strategy.TensorParallelStrategyMixin`).
    """

    strategy_name = STRATEGY_NAME

    def _setup_model(self, model: Module) -> DistributedDataParallel:
        return self._data_parallel_ddp(model, self.determine_ddp_device_ids())

    def setup(self, trainer: Any) -> None:
        assert self.model is not None
        self._check_describable(self.model)  # configure_model has run: refuse now, not at the first save
        if trainer.state.fn == TrainerFn.FITTING:
            self._check_checkpoint_dirs(trainer)
        if trainer.state.fn == TrainerFn.FITTING and self.checkpoint_io.config.async_save:
            warn_async_link_last(trainer)
        if trainer.state.fn == TrainerFn.FITTING:
            super().setup(trainer)  # wraps in DDP (over the DP group, see _setup_model)
            return
        # Not fitting: DDPStrategy would broadcast rank 0's weights to the whole world, overwriting
        # other TP ranks' shards; sync over the DP group instead.
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self._broadcast_over_data_parallel(self.model)
        self.setup_precision_plugin()

    def _staged_bytes_estimate(self) -> Tuple[int, bool]:
        """What a save stages on this rank: its module and optimizer tensors, shared out among the
        data-parallel replicas (each writes its part of the replicated shards), and whether any is
        on an accelerator."""
        assert self.lightning_module is not None
        tensors = [*self.lightning_module.parameters(), *self.lightning_module.buffers()]
        tensors += [v for o in self._raw_optimizers() for st in o.state.values() for v in st.values()
                    if isinstance(v, torch.Tensor) and v.dim() > 0]
        ps = self.parallel_state
        held = [(t, ps.dp_size, ps.dp_rank == 0) for t in tensors]  # every DP replica holds them, the first is main
        return staged_share(held, self.checkpoint_io.config.balance_writes)

    def _broadcast_over_data_parallel(self, module: Module) -> None:
        ps = self.parallel_state
        if ps.dp_size == 1:
            return
        comm = get_comm(ps.dp_group)
        with torch.no_grad():
            for t in list(module.parameters()) + list(module.buffers()):
                comm.broadcast_tensor(t.data, 0).wait()

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        # The module and the callbacks are restored before setup, as stock DDP restores them (on_fit_start
        # hooks see them); the optimizer state, loaded in place, once the optimizers exist (trainer_restore).
        return False

    def _raw_optimizers(self) -> List[Optimizer]:
        return [o._optimizer if isinstance(o, LightningOptimizer) else o for o in self.optimizers]

    def _model_ssd(self) -> Dict[str, Any]:
        assert self.lightning_module is not None
        return model_sharded_state_dict(self.lightning_module, self._checkpoint_parallel_state())

    def _checkpoint_parallel_state(self) -> ParallelState:
        """The strategy's TP x DP place; before it set up its environment (a Trainer saving before
        any fit / validate, as stock DDP's rank 0 can), in a one-process job with no process group:
        one process, so the save is the same one-process save the strategy makes after setup."""
        if self._parallel_state is None and self.world_size == 1 and not get_comm().distributed:
            return ParallelState.single()
        return self.parallel_state

    def _optimizer_states(self, model_ssd: Dict[str, Any]) -> List[Dict[str, Any]]:
        """Each optimizer's state, sharded like the parameters of ``model_ssd``."""
        return [optimizer_sharded_state(opt, model_ssd, optimizer_prefix(i), init_state=True)
                for i, opt in enumerate(self._raw_optimizers())]

    def save_checkpoint(self, checkpoint: Dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        """Collective: every rank saves its shards of the model and optimizer state; the rest of
        ``checkpoint`` (loops, callbacks, schedulers, hyper-parameters) is common state. A rank that cannot
        build its tree fails the save's handshake (:func:`~.sharded.failing_tree`): every rank raises its
        error, in one collective round fewer than an agreement of its own before the save."""
        self.saving_together()
        checkpoint_location(filepath, "filepath")  # a bad path is refused alike on every rank, before anything
        tree = tree_or_failing(lambda: self.checkpoint_tree(checkpoint))
        if self._parallel_state is None:
            # Before the first run, as after a teardown: no later hook would commit a background save.
            self.checkpoint_io.background_saves = False
        self.checkpoint_io.save_sharded(tree, filepath, storage_options=storage_options,
                                        background_snapshot=self.snapshot_selector())
        self.saved_together()

    def sharded_checkpoint(self, checkpoint: Dict[str, Any], what: str) -> Dict[str, Any]:
        """Collective: the tree :meth:`save_checkpoint` saves for Lightning's ``checkpoint`` dict (the
        module's and optimizers' shards; the rest common state). ``what`` names the save in errors."""
        return build_on_all_ranks(what, lambda: self.checkpoint_tree(checkpoint))

    def lightning_module_state_dict(self) -> Dict[str, Any]:
        # Lightning puts this dict under checkpoint["state_dict"] before the on_save_checkpoint hooks
        # run; kept (until the save) to tell a hook's replacement of it from it (_state_dict_to_save).
        self._handed_state_dict: Optional[Dict[str, Any]] = super().lightning_module_state_dict()
        return self._handed_state_dict

    def _state_dict_to_save(self, checkpoint: Dict[str, Any], model_ssd: Dict[str, Any]) -> Dict[str, Any]:
        """The module's shards, unless a hook replaced ``checkpoint["state_dict"]`` (``WeightAveraging``
        puts the average there, ``ModelPruning(make_pruning_permanent=True)`` the pruned weights): stock
        saves that dict, so we do where its tensors are whole (TP 1). At TP > 1 its tensors are this rank's
        pieces with no place in the global tensor: the module's shards are saved, with a warning."""
        handed, self._handed_state_dict = getattr(self, "_handed_state_dict", None), None
        given = checkpoint.get("state_dict")
        if handed is None or given is handed or not isinstance(given, dict):
            return model_ssd
        if all_whole(model_ssd):
            return replicated_state_dict(given, self._checkpoint_parallel_state())
        log.warning("a hook replaced checkpoint['state_dict'] (e.g. WeightAveraging, ModelPruning); under tensor "
                    "parallelism its tensors do not say where they sit, so the module's shards are saved instead")
        return model_ssd

    def checkpoint_tree(self, checkpoint: Dict[str, Any]) -> Dict[str, Any]:
        """This rank's tree for Lightning's ``checkpoint`` dict, built locally (no collective;
        :meth:`sharded_checkpoint` is the collective form that agrees on a failure): the module's and
        optimizers' shards, the rest common state."""
        model_ssd = self._model_ssd()
        rest = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        tree = rank_zero_tensors(rest, self.global_rank)  # rank 0's, as stock saves them
        assert self.lightning_module is not None
        tree["state_dict"] = self._state_dict_to_save(checkpoint, model_ssd)
        if "optimizer_states" in checkpoint:
            tree["optimizer_states"] = self._optimizer_states(model_ssd)
        tree[MANIFEST_KEY] = manifest(tree, KIND_SHARDED, ordered_as=checkpoint)  # before the next step: alike on all
        # Tensors that may differ by DP rank (buffers; a hook's dict) are the main replica's, as stock saves rank 0's.
        parameters = list(self.lightning_module.parameters()) if tree["state_dict"] is model_ssd else []
        tree["state_dict"] = main_replicas_of_buffers(tree["state_dict"], parameters)
        return tree

    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        options = self.checkpoint_io.config.tier_options
        if options is not None:  # tiers: a TierCheckpoint before ckpt_path resolves
            self._launcher = with_tier_callback(self._launcher, options)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> Dict[str, Any]:
        """Collective, before setup: every rank reads its shards of the module (in place) and the
        common state, the checkpoint opened once; the optimizer state is read once the optimizers
        exist (:meth:`load_optimizer_state_dict`, :mod:`.trainer_restore`). ``weights_only`` is
        accepted for the signature: loading is always safe."""
        path = checkpoint_location(checkpoint_path, "checkpoint_path")
        assert self.lightning_module is not None
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        if is_tier_marker(path):  # ckpt_path="last" with tiers: the newest recoverable step of any tier
            return load_recovery_point(self, path, fitting)
        with lightning_not_found(checkpoint_path):
            return load_before_setup(self, path, fitting)

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Collective: Lightning's step that puts the loaded weights into the module, its outcome agreed.
        Lightning calls it on every rank after :meth:`load_checkpoint`; a rank whose values do not fit (a
        factory's ``merge_fn`` giving it another shape) raised alone, and the others waited for it in
        setup's collectives. Now every rank raises that rank's error, before setup."""
        load = super().load_model_state_dict
        # the checkpoint's module weights no rank asked for: refused here, where stock refuses them (after
        # on_load_checkpoint and the module's load_state_dict pre-hooks), unless a hook dropped them
        unused, self._unused_weights = getattr(self, "_unused_weights", None), None
        assert self.lightning_module is not None
        module = self.lightning_module

        def restore() -> None:
            with refusing_placeholders(module, unused, "state_dict", strict):
                load(checkpoint, strict=strict)
        build_on_all_ranks("restore of the module's weights", restore, failed=AFTER_READING)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Collective: the optimizer state :meth:`load_checkpoint` left for after setup, in place.
        A checkpoint with no optimizer state at all (``optimizer_states={}``) restores none, as stock."""
        states = checkpoint["optimizer_states"]
        if isinstance(states, DeferredTierOptimizerStates):
            states.restore(self)
            return
        if isinstance(states, DeferredOptimizerStates):
            restore_after_setup(self, states)
            return
        optimizers = self._raw_optimizers()
        if states and len(states) != len(optimizers):
            raise CheckpointingError(f"the checkpoint has {len(states)} optimizer states, "
                                     f"the module has {len(optimizers)} optimizers")
        for opt, state in zip(optimizers, states):
            restore_optimizer(opt, state)


DistCheckpointStrategy.register_strategies(StrategyRegistry)
