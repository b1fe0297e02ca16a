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
from datetime import timedelta
from typing import Any, Callable, Dict, List, Mapping, Optional, Union

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment, Precision
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import STRATEGY_REGISTRY, DDPStrategy
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.fabric.utilities.types import _Stateful
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

from ..core.errors import MissingKeysError
from ..core.strict import StrictHandling
from .checkpoint_io import DistCheckpointIO
from .config import ConfigLike, DistCheckpointConfig, load_checkpoint_config, load_strategy_config
from .parallel import ParallelState, check_strategy_args, register_strategy_names
from .sharded import build_on_all_ranks, model_sharded_state_dict, optimizer_sharded_state, restore_optimizer
from .tree import KIND_SHARDED, MANIFEST_KEY, manifest

log = logging.getLogger("lightning_distckpt")



def _unwrap(module: Module) -> Module:
    return module.module if isinstance(module, DistributedDataParallel) else module


def _strip(prefix: str, tree: Mapping[str, Any]) -> Dict[str, Any]:
    return {k[len(prefix):] if k.startswith(prefix) else k: v for k, v in tree.items()}


class FabricDistCheckpointStrategy(DDPStrategy):
    """Fabric's DDP over the data-parallel group of a TP x DP grid, saving distributed checkpoints.

    ``fabric.save(path, state)`` / ``fabric.load(path, state)`` with modules (described by their
    ``sharded_state_dict(prefix)``, or replicated whole when they define none), optimizers (state
    sharded like their parameters), stateful objects and plain values. Every rank takes part.
    ``fabric.load(path)`` with no state returns the whole checkpoint, each tensor whole.

    Args:
        tensor_parallel_size: TP ranks per model replica (must divide the world size).
        checkpoint: checkpoint settings (:class:`DistCheckpointConfig`, mapping, or YAML path).
        Other arguments: as :class:`lightning.fabric.strategies.DDPStrategy`.
    """

    def __init__(
        self,
        tensor_parallel_size: int = 1,
        checkpoint: Optional[Union[str, Dict[str, Any]]] = None,
        accelerator: Optional[Any] = None,
        parallel_devices: Optional[List[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision: Optional[Precision] = None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        start_method: str = "popen",
        **ddp_kwargs: Any,
    ) -> None:
        tensor_parallel_size = check_strategy_args("FabricDistCheckpointStrategy", tensor_parallel_size, ddp_kwargs)
        super().__init__(
            accelerator=accelerator, parallel_devices=parallel_devices, cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io, precision=precision, process_group_backend=process_group_backend,
            timeout=timeout, start_method=start_method, **ddp_kwargs,  # type: ignore[arg-type]
        )
        self.tensor_parallel_size = int(tensor_parallel_size)
        self._checkpoint_config: DistCheckpointConfig = load_checkpoint_config(checkpoint)  # type: ignore[arg-type]
        self._parallel_state: Optional[ParallelState] = None

    @classmethod
    def from_config(cls, cfg: ConfigLike, **kwargs: Any) -> "FabricDistCheckpointStrategy":
        sc = load_strategy_config(cfg)
        return cls(tensor_parallel_size=sc.tensor_parallel_size, checkpoint=sc.checkpoint, **kwargs)  # type: ignore[arg-type]

    @classmethod
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        """Fabric's registration hook: ``Fabric(strategy="ddp_distckpt")`` (and ``"ddp_distckpt_spawn"``)."""
        register_strategy_names(cls, strategy_registry)

    # -- process groups ------------------------------------------------------------------
    @property
    def parallel_state(self) -> ParallelState:
        """This rank's place in the TP x DP grid and its process groups (after ``fabric.launch()``)."""
        if self._parallel_state is None:
            raise RuntimeError("FabricDistCheckpointStrategy.parallel_state is available after fabric.launch()")
        return self._parallel_state

    def setup_environment(self) -> None:
        self.checkpoint_io  # fail early (before any process group exists) on a foreign CheckpointIO
        super().setup_environment()
        self._parallel_state = ParallelState.build(self.tensor_parallel_size)

    @property
    def distributed_sampler_kwargs(self) -> Dict[str, Any]:
        ps = self.parallel_state
        return {"num_replicas": ps.dp_size, "rank": ps.dp_rank}

    def setup_module(self, module: Module) -> DistributedDataParallel:
        """DDP over the data-parallel group only (TP shards are neither averaged nor overwritten)."""
        return DistributedDataParallel(module=module, device_ids=self._determine_ddp_device_ids(),
                                       process_group=self.parallel_state.dp_group, **self._ddp_kwargs)

    # -- checkpoint I/O ------------------------------------------------------------------
    @property
    def checkpoint_io(self) -> DistCheckpointIO:
        if self._checkpoint_io is None:
            self._checkpoint_io = DistCheckpointIO(self._checkpoint_config)
        if not isinstance(self._checkpoint_io, DistCheckpointIO):
            raise TypeError(f"FabricDistCheckpointStrategy needs a DistCheckpointIO, got {type(self._checkpoint_io).__name__}")
        return self._checkpoint_io

    @checkpoint_io.setter
    def checkpoint_io(self, io: Optional[CheckpointIO]) -> None:
        self._checkpoint_io = io

    def _module_ssds(self, state: Mapping[str, Any]) -> Dict[str, Dict[str, Any]]:
        ps = self.parallel_state
        return {name: model_sharded_state_dict(_unwrap(obj), ps, prefix=f"{name}.")
                for name, obj in state.items() if isinstance(obj, Module)}

    def save_checkpoint(self, path: Any, state: Dict[str, Any], storage_options: Optional[Any] = None,
                        filter: Optional[Dict[str, Callable[[str, Any], bool]]] = None) -> None:
        """Collective save of ``state``: modules and optimizers sharded, the rest common state."""
        filter = filter or {}

        def build() -> Dict[str, Any]:
            module_ssds = self._module_ssds(state)
            all_params = {k: v for ssd in module_ssds.values() for k, v in ssd.items()}
            tree: Dict[str, Any] = {}
            for name, obj in state.items():
                if isinstance(obj, Module):
                    value: Any = module_ssds[name]
                    if name in filter:
                        prefix = f"{name}."
                        value = {k: v for k, v in value.items() if filter[name](k[len(prefix):], v)}
                elif isinstance(obj, Optimizer):
                    value = optimizer_sharded_state(obj, all_params, name, init_state=True)
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
            raise TypeError("FabricDistCheckpointStrategy.load_checkpoint: pass a dict such as {'model': model}, "
                            "not a bare module or optimizer")
        handling = self.checkpoint_io.config.strict_handling if strict else StrictHandling.LOG_ALL

        def build() -> Dict[str, Any]:
            module_ssds = self._module_ssds(state)
            all_params = {k: v for ssd in module_ssds.values() for k, v in ssd.items()}
            template: Dict[str, Any] = {}
            for name, obj in state.items():
                if isinstance(obj, Module):
                    template[name] = module_ssds[name]
                elif isinstance(obj, Optimizer):
                    template[name] = optimizer_sharded_state(obj, all_params, name, init_state=True)
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
