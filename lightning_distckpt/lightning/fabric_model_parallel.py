"""``FabricDistCheckpointModelParallelStrategy``: Fabric's ``ModelParallelStrategy`` (FSDP2 / tensor
parallel through DTensor) with ``fabric.save`` / ``fabric.load`` in our format instead of DCP.

    fabric = Fabric(devices=4, strategy=FabricDistCheckpointModelParallelStrategy(parallelize, 2, 2))
    fabric.launch()
    model, optimizer = fabric.setup(model, optimizer)         # parallelize(model, device_mesh) runs here
    fabric.save(path, {"model": model, "optimizer": optimizer, "step": step})    # every rank
    fabric.load(path, state)                                  # in place, under any mesh

A module entry is ``get_model_state_dict`` (keys ``<entry>/<fqn>``), an optimizer entry
``get_optimizer_state_dict`` over the module holding its parameters (``<entry>/state/<fqn>/exp_avg``),
DTensors as sharded tensors (see :mod:`.model_parallel`); ``state_dict()``-able objects and plain
values are common state.
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta
from typing import Any, Callable, Dict, List, Literal, Mapping, Optional, Tuple, Union

from lightning.fabric.plugins import CheckpointIO
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import ModelParallelStrategy
from lightning.fabric.utilities.types import _Stateful
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)
from torch.distributed.tensor import DTensor
from torch.nn import Module
from torch.optim import Optimizer

from ..comm import get_comm
from ..core.dtensors import restore_dtensor
from ..core.plain_tensors import shard_tensors
from ..core.errors import CheckpointingError, MissingKeysError
from ..core.strict import StrictHandling
from ..optim.restore_checks import load_checked
from ..storage.paths import checkpoint_location
from .fabric_raw import check_state_arg, load_raw_sharded_module
from .collectives import FabricCollectivesMixin
from .sharded_only import sharded_only
from .restore_source import RestoreSource
from .config import DistCheckpointConfig, load_checkpoint_config
from .model_parallel import (Path, drop_unsaved_states, is_lightning_dcp, put_value, refusal, shard_tree,
                             stock_weights_only, value_at)
from .sharded import build_on_all_ranks, describe_source
from .stock import tensors_metadata
from .snapshot_fence import FabricBackgroundSnapshotMixin
from .tp_strategy import DistCheckpointIOMixin
from .tree import (KIND_MODEL_PARALLEL, MANIFEST_KEY, leave_out, manifest, rank_zero_tensors, template_from_manifest,
                   without_manifest)

log = logging.getLogger(__name__)


def _owner(optimizer: Optimizer, state: Mapping[str, Any]) -> Module:
    """The module of ``state`` holding the optimizer's parameters (torch's state-dict API needs it)."""
    first = next((p for g in optimizer.param_groups for p in g["params"]), None)
    for obj in state.values():
        if isinstance(obj, Module) and any(p is first for p in obj.parameters()):
            return obj
    raise CheckpointingError("an optimizer in the state has no module of the same state holding its parameters; "
                             "save and load the module with its optimizer ({'model': model, 'optimizer': optimizer})")


class FabricDistCheckpointModelParallelStrategy(FabricCollectivesMixin, FabricBackgroundSnapshotMixin,
                                                DistCheckpointIOMixin, ModelParallelStrategy):
    """Fabric's ``ModelParallelStrategy`` whose ``fabric.save`` / ``fabric.load`` write and read our
    distributed checkpoints (any world size or DP x TP mesh on load).

    Args:
        parallelize_fn / data_parallel_size / tensor_parallel_size / process_group_backend / timeout /
            save_distributed_checkpoint (True only, :func:`~.sharded_only.sharded_only`): as
            :class:`lightning.fabric.strategies.ModelParallelStrategy`.
        checkpoint: checkpoint settings (:class:`DistCheckpointConfig`, mapping, or YAML path).
    """

    refuses_unused_weights = False  # as stock ModelParallelStrategy: a checkpoint's extra layer is left unread

    def __init__(self, parallelize_fn: Callable[[Any, Any], Any],
                 data_parallel_size: Union[Literal["auto"], int] = "auto",
                 tensor_parallel_size: Union[Literal["auto"], int] = "auto",
                 checkpoint: Optional[Union[str, Dict[str, Any], DistCheckpointConfig]] = None,
                 process_group_backend: Optional[str] = None,
                 timeout: Optional[timedelta] = default_pg_timeout, save_distributed_checkpoint: bool = True) -> None:
        super().__init__(parallelize_fn, data_parallel_size=data_parallel_size,
                         tensor_parallel_size=tensor_parallel_size,
                         save_distributed_checkpoint=sharded_only(self, save_distributed_checkpoint),
                         process_group_backend=process_group_backend, timeout=timeout)
        self._checkpoint_config: DistCheckpointConfig = load_checkpoint_config(checkpoint)
        self._checkpoint_io: Optional[CheckpointIO] = None

    def save_checkpoint(self, path: Any, state: Dict[str, Any], storage_options: Optional[Any] = None,
                        filter: Optional[Dict[str, Callable[[str, Any], bool]]] = None) -> None:
        """Collective save of ``state``: modules and optimizers sharded, the rest common state."""
        target = os.fspath(self.broadcast(checkpoint_location(path, "path")))
        tree = self.sharded_state(state, filter, f"save to {target}")
        self.checkpoint_io.save_sharded(tree, target, storage_options=storage_options,
                                        background_snapshot=self.snapshot_selector_for(state))

    def sharded_state(self, state: Dict[str, Any], filter: Optional[Dict[str, Callable[[str, Any], bool]]] = None,
                      what: str = "save") -> Dict[str, Any]:
        """Collective: the tree :meth:`save_checkpoint` saves for ``state``, ``filter``ed as it filters (``what``
        names the save in errors); also what :class:`~.fabric_tiers.FabricTiers` hands to the local tier."""
        filter = filter or {}

        def build() -> Dict[str, Any]:
            check_state_arg(state, type(self).__name__)
            tree: Dict[str, Any] = {}
            replicas: List[Tuple[Dict[Any, Any], Any]] = []
            for name, obj in state.items():
                if isinstance(obj, Module):
                    value: Any = get_model_state_dict(obj)
                elif isinstance(obj, Optimizer):
                    value = get_optimizer_state_dict(_owner(obj, state), obj)
                elif isinstance(obj, _Stateful):
                    value = obj.state_dict()
                else:
                    value = obj
                if name in filter and isinstance(value, dict):
                    value = {k: v for k, v in value.items() if filter[name](k, v)}
                # plain tensors rank 0's (buffers too), as stock Fabric saves them (they may differ by rank)
                rank = self.global_rank
                tree[name] = shard_tree(value, (name,), rank, {}, replicas) if isinstance(obj, (Module, Optimizer)) \
                    else rank_zero_tensors({name: value}, rank)[name]
            tree[MANIFEST_KEY] = manifest(tree, KIND_MODEL_PARALLEL)
            return leave_out(tree, replicas)

        return build_on_all_ranks(what, build)

    def state_template(self, state: Mapping[str, Any], dtensors: Dict[Path, DTensor]) -> Dict[str, Any]:
        """The modules' and optimizers' entries of ``state`` as sharded templates (local shards of their
        DTensors, each DTensor recorded in ``dtensors`` by its place, for :meth:`apply_state`)."""
        template: Dict[str, Any] = {}
        for name, obj in state.items():
            if isinstance(obj, Module):
                template[name] = get_model_state_dict(obj)
            elif isinstance(obj, Optimizer):
                template[name] = get_optimizer_state_dict(_owner(obj, state), obj)
        return {k: shard_tree(v, (k,), self.global_rank, dtensors) for k, v in template.items()}

    def apply_state(self, state: Dict[str, Any], loaded: Dict[str, Any], dtensors: Dict[Path, DTensor],
                    handling: StrictHandling, strict: bool, where: str) -> Dict[str, Any]:
        """The loaded entries put into ``state`` (modules and optimizers through torch's state-dict API,
        their DTensors rebuilt from the loaded local shards; stateful objects in place; plain values
        replaced); returns what ``state`` has no place for. ``dtensors``: the template's DTensors by place;
        ``handling`` / ``strict``: the load's strictness (``strict``: Fabric's flag); ``where`` names the checkpoint
        in errors."""
        loaded = without_manifest(loaded, where)  # its dicts' keys in the saved order, as torch.load gives them
        for place, dt in dtensors.items():
            put_value(loaded, place, restore_dtensor(dt, value_at(loaded, place)))
        absent = [name for name in state if name not in loaded]
        if strict and absent:
            raise MissingKeysError(f"checkpoint {where}: has no entry {absent} (load with strict=False to skip them)")
        options = StateDictOptions(strict=not handling.skips_unexpected)
        error: Optional[Exception] = None
        for name, obj in list(state.items()):
            if name not in loaded:
                continue
            value = loaded.pop(name)
            try:  # every entry on every rank (torch's state-dict calls may communicate); the outcome agreed below
                if isinstance(obj, Module):
                    set_model_state_dict(obj, value, options=options)
                elif isinstance(obj, Optimizer):
                    load_checked(obj, lambda: set_optimizer_state_dict(_owner(obj, state), obj, value,
                                                                       options=options),
                                 f"checkpoint {where}: optimizer {name!r}")
                elif isinstance(obj, _Stateful):
                    obj.load_state_dict(value)
                else:
                    state[name] = value
            except Exception as e:  # a stateful object's load_state_dict raising on one rank: not that rank alone
                error = error or e
        get_comm().agree(f"load from {where}: restore of the loaded state failed after reading", error)
        return loaded

    def load_checkpoint(self, path: Any, state: Optional[Union[Module, Optimizer, Dict[str, Any]]] = None,
                        strict: bool = True, weights_only: Optional[bool] = None) -> Dict[str, Any]:
        """Collective load into the modules and optimizers of ``state`` (in place, any mesh); returns
        what the checkpoint holds beyond ``state``. Without ``state``: the whole checkpoint, each
        tensor whole, read by this process alone. A module alone (``fabric.load_raw``): its weights from
        one full state-dict file, as the stock strategy loads it, read safely (:mod:`.fabric_raw`: ``weights_only``
        never widens what is unpickled); an optimizer alone is refused, as there."""
        target = os.fspath(self.broadcast(checkpoint_location(path, "path")))
        if isinstance(state, Optimizer):  # fabric.load_raw of an optimizer: refused, as stock refuses it
            return super().load_checkpoint(target, state, strict=strict)
        if isinstance(state, Module):  # fabric.load_raw (before `not state`: an empty nn.Sequential is falsy)
            load_raw_sharded_module(state, target, strict, self.checkpoint_io.extra_safe_globals, weights_only)
            return {}
        if not state:
            return self.checkpoint_io.load_checkpoint(target)
        extra = self.checkpoint_io.extra_safe_globals
        self.checkpoint_io.wait()  # a background save (of this path, maybe) commits before anything is opened
        dcp = self.checkpoint_io.open_source(target) if is_lightning_dcp(target) else None
        if dcp is not None and not describe_source(dcp, extra).by_trainer:
            # Fabric's own ModelParallelStrategy wrote it (DCP + meta.pt): read as that strategy reads it.
            log.info("checkpoint %s: Fabric's ModelParallelStrategy (DCP) layout, read as the stock strategy reads it",
                     target)
            return super().load_checkpoint(target, state, strict=strict,
                                           **stock_weights_only(super().load_checkpoint))
        dtensors: Dict[Path, DTensor] = {}
        handling = self.checkpoint_io.config.strict_handling if strict else StrictHandling.LOG_ALL

        def build() -> Tuple[RestoreSource, Dict[str, Any]]:
            # Opened once (a DCP directory above already): the checks, the template and the load share it.
            source = dcp if dcp is not None else self.checkpoint_io.open_source(target)
            saved = describe_source(source, extra)
            if saved.kind != KIND_MODEL_PARALLEL or saved.by_trainer:
                raise CheckpointingError(refusal(target, saved.kind, saved.by_trainer, type(self).__name__))
            out = self.state_template(state, dtensors)
            if handling.skips_unexpected:
                drop_unsaved_states(out, [(n,) for n, obj in state.items() if isinstance(obj, Optimizer)],
                                    source.index.tensors, dtensors)
            # Plain tensors (an optimizer's 0-d step) keyed by path, as a save stores them and FabricTiers' load
            # (lightning_distckpt.load) reads them: a strict load names them from either.
            out = shard_tensors(out, self.global_rank)
            # Entries not asked for come back complete: each of their tensors whole.
            whole = template_from_manifest(saved.manifest or {}, tensors_metadata(source), target)
            out.update({k: v for k, v in whole.items() if k not in state})
            return source, out

        source, template = build_on_all_ranks(f"load from {target}", build)
        modules = [name for name, obj in state.items() if isinstance(obj, Module)]
        loaded = self._load_modules(template, source, modules, strict, strict=handling)
        return self.apply_state(state, loaded, dtensors, handling, strict, target)
