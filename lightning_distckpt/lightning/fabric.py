"""``FabricDistCheckpointStrategy``: Fabric's DDP with TP x DP process groups and distributed checkpoints.

In a custom loop::

    fabric = Fabric(accelerator="cpu", devices=4, strategy=FabricDistCheckpointStrategy(tensor_parallel_size=2))
    fabric.launch()
    ps = fabric.strategy.parallel_state          # build tensor-parallel layers with it
    model, optimizer = fabric.setup(MyModel(ps), torch.optim.AdamW(...))
    fabric.save(path, {"model": model, "optimizer": optimizer, "step": step})   # every rank takes part
    fabric.load(path, state)                     # in place; any world size / TP split; strict or not
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable, Dict, Mapping, NamedTuple, Optional, Union

from lightning.fabric.strategies import STRATEGY_REGISTRY, DDPStrategy
from lightning.fabric.utilities.types import _Stateful
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

from ..core.errors import ArgumentTypeError, MissingKeysError
from ..core.strict import StrictHandling
from .sharded import build_on_all_ranks, model_sharded_state_dict, optimizer_sharded_state, restore_optimizer
from .tp_strategy import TensorParallelStrategyMixin
from .tree import KIND_SHARDED, MANIFEST_KEY, manifest

log = logging.getLogger(__name__)


class ModuleStates(NamedTuple):
    """The sharded state dicts of the modules in a ``fabric.save`` / ``fabric.load`` state."""

    by_name: Dict[str, Dict[str, Any]]  # state key -> that module's sharded state dict
    params: Dict[str, Any]  # all of them in one dict (the optimizers' parameters are among them)


def _unwrap(module: Module) -> Module:
    return module.module if isinstance(module, DistributedDataParallel) else module


def _strip(prefix: str, tree: Mapping[str, Any]) -> Dict[str, Any]:
    return {k[len(prefix):] if k.startswith(prefix) else k: v for k, v in tree.items()}


class FabricDistCheckpointStrategy(TensorParallelStrategyMixin, DDPStrategy):
    """Fabric's DDP over the data-parallel group of a TP x DP grid, saving distributed checkpoints.

    ``fabric.save(path, state)`` / ``fabric.load(path, state)`` with modules (described by their
    ``sharded_state_dict(prefix)``, or replicated whole when they define none), optimizers (state
    sharded like their parameters), stateful objects and plain values. Every rank takes part.
    ``fabric.load(path)`` with no state returns the whole checkpoint, each tensor whole.

    Args:
        tensor_parallel_size: TP ranks per model replica (must divide the world size).
        checkpoint: checkpoint settings (:class:`DistCheckpointConfig`, mapping, or YAML path).
        Other arguments: as :class:`lightning.fabric.strategies.DDPStrategy` (see
            :class:`~lightning_distckpt.lightning.tp_strategy.TensorParallelStrategyMixin`).
    """

    def setup_module(self, module: Module) -> DistributedDataParallel:
        return self._data_parallel_ddp(module, self._determine_ddp_device_ids())

    def _module_ssds(self, state: Mapping[str, Any]) -> ModuleStates:
        ps = self.parallel_state
        by_name = {name: model_sharded_state_dict(_unwrap(obj), ps, prefix=f"{name}.")
                   for name, obj in state.items() if isinstance(obj, Module)}
        return ModuleStates(by_name, {k: v for ssd in by_name.values() for k, v in ssd.items()})

    def save_checkpoint(self, path: Any, state: Dict[str, Any], storage_options: Optional[Any] = None,
                        filter: Optional[Dict[str, Callable[[str, Any], bool]]] = None) -> None:
        """Collective save of ``state``: modules and optimizers sharded, the rest common state."""
        filter = filter or {}

        def build() -> Dict[str, Any]:
            modules = self._module_ssds(state)
            tree: Dict[str, Any] = {}
            for name, obj in state.items():
                if isinstance(obj, Module):
                    value: Any = modules.by_name[name]
                    if name in filter:
                        prefix = f"{name}."
                        value = {k: v for k, v in value.items() if filter[name](k[len(prefix):], v)}
                elif isinstance(obj, Optimizer):
                    value = optimizer_sharded_state(obj, modules.params, name, init_state=True)
                elif isinstance(obj, _Stateful):
                    value = obj.state_dict()
                else:
                    value = obj
                if name in filter and not isinstance(obj, Module) and isinstance(value, dict):
                    value = {k: v for k, v in value.items() if filter[name](k, v)}
                tree[name] = value
            tree[MANIFEST_KEY] = manifest(tree, KIND_SHARDED)
            return tree

        tree = build_on_all_ranks(f"save to {os.fspath(path)}", build)
        self.checkpoint_io.save_sharded(tree, path, storage_options=storage_options)

    def load_checkpoint(self, path: Any, state: Optional[Union[Module, Optimizer, Dict[str, Any]]] = None,
                        strict: bool = True, weights_only: Optional[bool] = None) -> Dict[str, Any]:
        """Collective load into the objects of ``state`` (in place); returns what the checkpoint holds
        beyond ``state``. ``strict=False`` skips entries missing from the checkpoint (keeping their
        current values), per the configured handling otherwise. Without ``state``: the whole
        checkpoint, each tensor whole, read by this process alone."""
        target = os.fspath(path)
        if not state:
            return self.checkpoint_io.load_checkpoint(target)
        if isinstance(state, (Module, Optimizer)):
            raise ArgumentTypeError("FabricDistCheckpointStrategy.load_checkpoint: pass a dict such as {'model': model}, "
                            "not a bare module or optimizer")
        handling = self.checkpoint_io.config.strict_handling if strict else StrictHandling.LOG_ALL

        def build() -> Dict[str, Any]:
            modules = self._module_ssds(state)
            template: Dict[str, Any] = dict(modules.by_name)
            for name, obj in state.items():
                if isinstance(obj, Optimizer):
                    template[name] = optimizer_sharded_state(obj, modules.params, name, init_state=True)
            return template

        template = build_on_all_ranks(f"load from {target}", build)
        loaded = self.checkpoint_io.load_sharded(template, target, strict=handling,
                                                 data_parallel_group=self.parallel_state.dp_group)
        man = loaded.pop(MANIFEST_KEY, None)
        if not isinstance(man, Mapping) or man.get("kind") != KIND_SHARDED:
            log.warning("checkpoint %s was not saved by a distributed-checkpoint strategy", target)
        absent = [name for name in state if name not in loaded and name not in template]
        if strict and absent:
            raise MissingKeysError(f"checkpoint {target}: has no entry {absent} (load with strict=False to skip them)")
        for name, obj in list(state.items()):
            if name not in loaded:
                continue
            value = loaded.pop(name)
            if isinstance(obj, Module):
                _unwrap(obj).load_state_dict(_strip(f"{name}.", value), strict=strict)
            elif isinstance(obj, Optimizer):
                restore_optimizer(obj, value)
            elif isinstance(obj, _Stateful):
                obj.load_state_dict(value)
            else:
                state[name] = value
        return loaded


FabricDistCheckpointStrategy.register_strategies(STRATEGY_REGISTRY)
