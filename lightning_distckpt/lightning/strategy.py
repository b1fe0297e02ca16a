"""``DistCheckpointStrategy``: Lightning's DDP with TP x DP process groups and distributed checkpoints.

Every rank takes part in saving and loading. The LightningModule describes its tensors with
``sharded_state_dict(self, prefix="")`` (tensor-parallel layers return ShardedTensors wrapping their
parameters); the optimizer state follows its parameters' sharding; the rest of the trainer state
(loops, callbacks, LR schedulers, hyper-parameters) is common state written once.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch
import torch.distributed as dist
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

from ..core.errors import CheckpointingError
from ..storage.paths import checkpoint_location
from .checkpoint_io import FOREIGN_ADVICE, RestoreSource, fabric_writer, foreign_writer
from .parallel import STRATEGY_NAME
from .sharded import (build_on_all_ranks, describe_source, model_sharded_state_dict, optimizer_sharded_state,
                      restore_optimizer)
from .stock import (REST_KEY, ModuleEntry, OptimizerEntry, StoredLayout, is_tree_path_layout, place_stored_tensors,
                    rekey_template, restore_param_keys)
from .tp_strategy import AsyncCommitHooksMixin, TensorParallelStrategyMixin
from .tree import KIND_MODEL_PARALLEL, KIND_SHARDED, MANIFEST_KEY, manifest

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


class DistCheckpointStrategy(AsyncCommitHooksMixin, TensorParallelStrategyMixin, DDPStrategy):
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

    def _broadcast_over_data_parallel(self, module: Module) -> None:
        ps = self.parallel_state
        if ps.dp_size == 1:
            return
        src = dist.get_global_rank(ps.dp_group, 0)
        with torch.no_grad():
            for t in list(module.parameters()) + list(module.buffers()):
                dist.broadcast(t.data, src=src, group=ps.dp_group)

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        # Optimizers (whose sharded state is loaded in place) exist only after setup.
        return True

    def _raw_optimizers(self) -> List[Optimizer]:
        return [o._optimizer if isinstance(o, LightningOptimizer) else o for o in self.optimizers]

    def _model_ssd(self) -> Dict[str, Any]:
        assert self.lightning_module is not None
        return model_sharded_state_dict(self.lightning_module, self.parallel_state)

    def _optimizer_states(self, model_ssd: Dict[str, Any]) -> List[Dict[str, Any]]:
        """Each optimizer's state, sharded like the parameters of ``model_ssd``."""
        return [optimizer_sharded_state(opt, model_ssd, optimizer_prefix(i), init_state=True)
                for i, opt in enumerate(self._raw_optimizers())]

    def save_checkpoint(self, checkpoint: Dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        """Collective: every rank saves its shards of the model and optimizer state; the rest of
        ``checkpoint`` (loops, callbacks, schedulers, hyper-parameters) is common state."""
        def build() -> Dict[str, Any]:
            model_ssd = self._model_ssd()
            tree = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
            tree["state_dict"] = model_ssd
            if "optimizer_states" in checkpoint:
                tree["optimizer_states"] = self._optimizer_states(model_ssd)
            tree[MANIFEST_KEY] = manifest(tree, KIND_SHARDED)
            return tree

        tree = build_on_all_ranks(f"save to {checkpoint_location(filepath, 'filepath')}", build)
        self.checkpoint_io.save_sharded(tree, filepath, storage_options=storage_options)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> Dict[str, Any]:
        """Collective: every rank reads its shards (in place into its parameters and optimizer state)
        and the common state, the checkpoint opened once. ``weights_only`` is accepted for the
        signature: loading is always safe."""
        path = checkpoint_location(checkpoint_path, "checkpoint_path")
        assert self.lightning_module is not None
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        restore_optimizers = fitting and self.lightning_restore_optimizer

        def build() -> Tuple[StoredLayout, RestoreSource]:
            # Opened once: who wrote it is read from the common state the load then reuses.
            source = self.checkpoint_io.open_source(path)
            saved = describe_source(source, self.checkpoint_io.extra_safe_globals)
            # DistCheckpointModelParallelStrategy's tensors are named by path too, optimizer state by name.
            by_name = saved.kind == KIND_MODEL_PARALLEL
            by_path = is_tree_path_layout(path, saved.kind) or by_name
            if saved.kind != KIND_SHARDED and not by_path:
                writer = foreign_writer(path) if saved.kind is None else f"by a writer of kind {saved.kind!r}"
                raise CheckpointingError(f"checkpoint {path} was written {writer}, not by DistCheckpointStrategy, "
                                         f"DistCheckpointIO or torch.save. {FOREIGN_ADVICE}")
            if not saved.by_trainer and (saved.kind is not None or "pytorch-lightning_version" not in saved.entries):
                raise CheckpointingError(
                    f"checkpoint {path} was written {fabric_writer(saved.kind)} (entries {sorted(saved.entries)}), "
                    "not by a Trainer; load it with fabric.load, or a module's weights in one process with "
                    f"load_module_weights(module, {path!r}, entry=<its entry>)")
            model_ssd = self._model_ssd()
            template: Dict[str, Any] = {"state_dict": model_ssd}
            if restore_optimizers:
                template["optimizer_states"] = self._optimizer_states(model_ssd)
            if not by_path:
                return StoredLayout(template, {}), source
            # A stock .ckpt, or the plugin's directory: tensors named by their path in Lightning's dict.
            optimizers = [OptimizerEntry(f"optimizer_states/{i}", s, by_name)
                          for i, s in enumerate(template.get("optimizer_states", []))]
            return rekey_template(source, template, {"state_dict": ModuleEntry("state_dict/", "")}, optimizers,
                                  ("state_dict/", "optimizer_states/"), self.checkpoint_io.extra_safe_globals), source

        layout, source = build_on_all_ranks(f"load from {path}", build)
        strict = self._strict_handling()
        loaded = self.checkpoint_io.load_sharded(layout.template, source, strict=strict,
                                                 data_parallel_group=self.parallel_state.dp_group)
        if REST_KEY in layout.template:
            loaded = place_stored_tensors(loaded, layout, path)
            if restore_optimizers:
                loaded["optimizer_states"] = [restore_param_keys(s, s["param_keys"], path)
                                              for s in loaded["optimizer_states"]]
        loaded.pop(MANIFEST_KEY, None)
        if fitting and strict.skips_unexpected and "lr_schedulers" not in loaded:
            # Non-strict resume from a weights-only checkpoint: keep the fresh scheduler states.
            log.warning("checkpoint %s has no LR scheduler state; keeping the current schedulers (non-strict)", path)
            loaded["lr_schedulers"] = [c.scheduler.state_dict() for c in self.lr_scheduler_configs]
        return loaded

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        states = checkpoint["optimizer_states"]
        optimizers = self._raw_optimizers()
        if len(states) != len(optimizers):
            raise CheckpointingError(f"the checkpoint has {len(states)} optimizer states, the module has {len(optimizers)} optimizers")
        for opt, state in zip(optimizers, states):
            restore_optimizer(opt, state)


DistCheckpointStrategy.register_strategies(StrategyRegistry)
