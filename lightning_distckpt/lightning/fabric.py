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

import contextlib
import logging
import os
from typing import Any, Callable, Dict, List, Mapping, NamedTuple, Optional, Set, Tuple, Union

from lightning.fabric.strategies import STRATEGY_REGISTRY, DDPStrategy
from lightning.fabric.utilities.types import _Stateful
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

from ..core.errors import ArgumentError, CheckpointingError, MissingKeysError
from ..core.strict import StrictHandling, check_keys, deferring_absent
from ..storage.paths import checkpoint_location
from .collectives import FabricCollectivesMixin
from .fabric_raw import check_state_arg, load_raw_module, load_raw_optimizer
from .foreign import foreign_writer
from .restore_source import RestoreSource
from .sharded import (AFTER_READING, build_on_all_ranks, describe_source, main_replicas_of_buffers,
                      model_sharded_state_dict, optimizer_sharded_state, restore_optimizer)
from .snapshot_fence import FabricBackgroundSnapshotMixin
from .tp_strategy import TensorParallelStrategyMixin
from .unused_weights import (UnusedWeights, hold_absent, insert_placeholders, module_templates,
                             placeholders, refusing_placeholders)
from .stock import (REST_KEY, ModuleEntry, OptimizerEntry, SavedCheckpoint, StoredLayout, is_tree_path_layout,
                    place_stored_tensors, rekey_template, restore_param_keys, tensors_metadata)
from .tree import (KIND_MODEL_PARALLEL, KIND_SHARDED, MANIFEST_KEY, manifest, rank_zero_tensors,
                   template_from_manifest, without_manifest)

log = logging.getLogger(__name__)


class ModuleStates(NamedTuple):
    """The sharded state dicts of the modules in a ``fabric.save`` / ``fabric.load`` state."""

    by_name: Dict[str, Dict[str, Any]]  # state key -> that module's sharded state dict
    params: Dict[str, Any]  # all of them in one dict (the optimizers' parameters are among them)


def _unwrap(module: Module) -> Module:
    return module.module if isinstance(module, DistributedDataParallel) else module


def _strip(prefix: str, tree: Mapping[str, Any]) -> Dict[str, Any]:
    return {k[len(prefix):] if k.startswith(prefix) else k: v for k, v in tree.items()}


class FabricDistCheckpointStrategy(FabricCollectivesMixin, FabricBackgroundSnapshotMixin, TensorParallelStrategyMixin,
                                   DDPStrategy):
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
        self._check_describable(module)  # refuse now, not at the first save
        return self._data_parallel_ddp(module, self._determine_ddp_device_ids())

    def _module_ssds(self, state: Mapping[str, Any]) -> ModuleStates:
        """Each module's sharded state dict under its state name: the dict keys are the module's own
        ``state_dict`` keys (what reading the checkpoint whole gives back), the ShardedTensors' keys
        carry the state name (``model.fc1.weight``), so two modules never collide."""
        ps = self.parallel_state
        by_name = {name: _strip(f"{name}.", model_sharded_state_dict(_unwrap(obj), ps, prefix=f"{name}."))
                   for name, obj in state.items() if isinstance(obj, Module)}
        return ModuleStates(by_name, {f"{name}.{k}": v for name, ssd in by_name.items() for k, v in ssd.items()})

    def save_checkpoint(self, path: Any, state: Dict[str, Any], storage_options: Optional[Any] = None,
                        filter: Optional[Dict[str, Callable[[str, Any], bool]]] = None) -> None:
        """Collective save of ``state``: modules and optimizers sharded, the rest common state."""
        tree = self.sharded_state(state, filter, f"save to {checkpoint_location(path, 'path')}")
        self.checkpoint_io.save_sharded(tree, path, storage_options=storage_options,
                                        background_snapshot=self.snapshot_selector_for(state))

    def sharded_state(self, state: Dict[str, Any], filter: Optional[Dict[str, Callable[[str, Any], bool]]] = None,
                      what: str = "save") -> Dict[str, Any]:
        """Collective: the tree :meth:`save_checkpoint` saves for ``state``, ``filter``ed as it filters (``what``
        names the save in errors)."""
        filter = filter or {}

        def build() -> Dict[str, Any]:
            check_state_arg(state, type(self).__name__)
            modules = self._module_ssds(state)
            tree: Dict[str, Any] = {}
            for name, obj in state.items():
                if isinstance(obj, Module):
                    value: Any = modules.by_name[name]
                    if name in filter:
                        value = {k: v for k, v in value.items() if filter[name](k, v)}
                elif isinstance(obj, Optimizer):
                    value = optimizer_sharded_state(obj, modules.params, name, init_state=True)
                elif isinstance(obj, _Stateful):
                    value = obj.state_dict()
                else:
                    value = obj
                if name in filter and not isinstance(obj, Module) and isinstance(value, dict):
                    value = {k: v for k, v in value.items() if filter[name](k, v)}
                if not isinstance(obj, (Module, Optimizer)):  # its plain tensors rank 0's, as stock Fabric saves
                    value = rank_zero_tensors({name: value}, self.global_rank)[name]  # them (they may differ)
                tree[name] = value
            tree[MANIFEST_KEY] = manifest(tree, KIND_SHARDED)  # before the next step: the same on every rank
            for name, obj in state.items():  # buffers the main replica's: they may differ by rank, stock saves rank 0's
                if isinstance(obj, Module):
                    tree[name] = main_replicas_of_buffers(tree[name], list(obj.parameters()))
            return tree

        return build_on_all_ranks(what, build)

    def load_checkpoint(self, path: Any, state: Optional[Union[Module, Optimizer, Dict[str, Any]]] = None,
                        strict: bool = True, weights_only: Optional[bool] = None) -> Dict[str, Any]:
        """Collective load into the objects of ``state`` (in place); returns what the checkpoint holds
        beyond ``state``. ``strict=False`` skips entries missing from the checkpoint (keeping their
        current values), per the configured handling otherwise. Without ``state``: the whole
        checkpoint, each tensor whole, read by this process alone. A module or optimizer alone
        (``fabric.load_raw``): one state-dict file, read safely (:mod:`.fabric_raw`)."""
        if isinstance(state, (Module, Optimizer)):  # fabric.load_raw: one state-dict file, as stock loads it
            self._load_raw(path, state, strict, weights_only)
            return {}
        target = checkpoint_location(path, "path")
        if not state:
            return self.checkpoint_io.load_checkpoint(target)
        handling = self.checkpoint_io.config.strict_handling if strict else StrictHandling.LOG_ALL
        # A background save of this path (fabric.save just before) commits first: opened before it, the
        # load failed on the placeholder or on the older checkpoint its commit replaced under the reads.
        self.checkpoint_io.wait()
        # Opened once: the checks and the template read the metadata and common state the load reuses.
        source, layout = build_on_all_ranks(f"load from {target}", lambda: self._load_template(target, state))
        entries = self._module_entries(source, state)
        # a module's weights no rank asks for: refused by its load_state_dict (after its pre-hooks), as stock's;
        # found under strict=False too, where a pre-hook may rename them onto the module's keys (else logged)
        found: Optional[Set[str]] = set() if entries != ["state_dict"] else None
        held: Set[str] = set()  # the module's keys the checkpoint lacks, where it has such weights: checked after
        dp_group = self.parallel_state.dp_group
        with deferring_absent(held) if found is not None else contextlib.nullcontext():
            loaded = self._load_modules(layout.template, source, entries, strict or found is not None, found,
                                        strict=handling, data_parallel_group=dp_group)

        def read(entry: str, template: Dict[str, Any]) -> Dict[str, Any]:  # collective: a placeholder a hook moved
            return self.checkpoint_io.load_sharded({entry: template}, source, strict=StrictHandling.
                                                   ASSUME_OK_UNEXPECTED, data_parallel_group=dp_group)[entry]
        unused = UnusedWeights(target, read=read, templates=module_templates(layout.template, entries),
                               lenient="fabric.load(..., strict=False)")
        for name in entries if found else ():  # named from the manifest, before it leaves the common state
            if isinstance(loaded.get(name), dict):
                insert_placeholders(unused, name, loaded[name], placeholders(source, found, name,
                                                                             self.checkpoint_io.extra_safe_globals))
        hold_absent(unused, loaded, held, lambda keys: check_keys(handling, target, (), keys, keys,
                                                                  unasked=set(found or ())),
                    strict=not handling.skips_unexpected)
        if REST_KEY in layout.template:
            loaded = place_stored_tensors(loaded, layout, target)
            for name, obj in state.items():
                if isinstance(obj, Optimizer) and name in loaded:
                    loaded[name] = restore_param_keys(layout.stored_optimizer(loaded, name), loaded[name]["param_keys"],
                                                      target)
        loaded = without_manifest(loaded, target)  # its dicts' keys in the saved order, as torch.load gives them
        absent = [name for name in state if name not in loaded and name not in layout.template]
        if strict and absent:
            raise MissingKeysError(f"checkpoint {target}: has no entry {absent} (load with strict=False to skip them)")
        return apply_loaded(state, loaded, strict, unused)

    def _load_raw(self, path: Any, obj: Union[Module, Optimizer], strict: bool, weights_only: Optional[bool]) -> None:
        """``fabric.load_raw(path, obj)``: a module's (this rank's TP slices) or an optimizer's state from one
        state-dict file, as stock Fabric DDP loads it; collective (the outcome agreed)."""
        target, extra = checkpoint_location(path, "path"), self.checkpoint_io.extra_safe_globals
        if isinstance(obj, Module):
            return load_raw_module(_unwrap(obj), target, self.parallel_state, strict, extra, weights_only)
        if self.parallel_state.tp_size > 1:  # the file's moments are whole, the parameters TP shards
            raise ArgumentError(f"fabric.load_raw({target!r}, optimizer): a bare optimizer loads under "
                                "tensor_parallel_size=1 only; save and load it with fabric.save / fabric.load")
        return load_raw_optimizer(obj, target, extra, weights_only)

    def _module_entries(self, source: RestoreSource, state: Mapping[str, Any]) -> List[str]:
        """Where the modules of ``state`` sit in the checkpoint: under their names, or a Trainer's ``state_dict``
        where :meth:`_template` reads a Trainer's checkpoint into the state's one module."""
        modules = [name for name, obj in state.items() if isinstance(obj, Module)]
        asked = [name for name, obj in state.items() if isinstance(obj, (Module, Optimizer))]
        saved = describe_source(source, self.checkpoint_io.extra_safe_globals)
        return ["state_dict"] if asked and saved.by_trainer and not set(asked) & saved.entries else modules

    def _load_template(self, target: str, state: Mapping[str, Any]) -> Tuple[RestoreSource, StoredLayout]:
        """The checkpoint opened, and the template for ``fabric.load(target, state)``: the state's
        modules and optimizers sharded (re-keyed to the stored names for a ``torch.save`` file or a
        directory the plugin wrote), and every other tensor of the checkpoint whole, so what the load
        returns is complete."""
        source = self.checkpoint_io.open_source(target)
        return source, self._template(target, source, state)

    def _template(self, target: str, source: RestoreSource, state: Mapping[str, Any]) -> StoredLayout:
        """The template of :meth:`_load_template`, from the opened ``source``."""
        saved = describe_source(source, self.checkpoint_io.extra_safe_globals)
        kind, man = saved.kind, saved.manifest
        modules = self._module_ssds(state)
        template: Dict[str, Any] = dict(modules.by_name)
        optimizers = [name for name, obj in state.items() if isinstance(obj, Optimizer)]
        for name in optimizers:
            template[name] = optimizer_sharded_state(state[name], modules.params, name, init_state=True)
        asked = [*modules.by_name, *optimizers]
        if asked and saved.by_trainer and not set(asked) & saved.entries:
            return self._trainer_layout(target, source, saved, template, optimizers)
        if is_tree_path_layout(target, kind):  # stock Fabric's torch.save file, or the plugin's directory
            return rekey_template(source, template, {n: ModuleEntry(f"{n}/", f"{n}.") for n in modules.by_name},
                                  [OptimizerEntry(n, template[n]) for n in optimizers],
                                  tuple(f"{n}/" for n in template), self.checkpoint_io.extra_safe_globals)
        if kind == KIND_MODEL_PARALLEL:  # DTensor state keyed by path: not this strategy's layout
            raise CheckpointingError(
                f"checkpoint {target} was written by FabricDistCheckpointModelParallelStrategy (FSDP2 / DTensor state, "
                "optimizer state keyed by parameter name), not by FabricDistCheckpointStrategy; load it with "
                "FabricDistCheckpointModelParallelStrategy (any mesh), with stock Fabric + DistCheckpointIO, or load a "
                f"module's weights with load_module_weights(module, {target!r}, entry=...)")
        if kind == KIND_SHARDED:  # the entries not asked for: each tensor whole
            whole = template_from_manifest(man, tensors_metadata(source), target)
            template.update({k: v for k, v in whole.items() if k not in state})
        else:
            # ldc.save's own directories, DCP and other foreign checkpoints: no Lightning manifest, nothing wrong
            # (a key the state asks for and the checkpoint lacks is still refused by the strict load)
            log.info("checkpoint %s has no Lightning / Fabric manifest (saved by ldc.save or another tool); "
                     "loading by key", target)
        return StoredLayout(template, {})

    def _trainer_layout(self, target: str, source: RestoreSource, saved: SavedCheckpoint, template: Dict[str, Any],
                        optimizers: List[str]) -> StoredLayout:
        """A Trainer's checkpoint (opened as ``source``) into a Fabric state with one module: its
        ``state_dict`` into the module, its ``optimizer_states`` in order into the state's optimizers (a
        stock ``.ckpt`` file or the plugin's directory: tensors named by path); the rest is returned as
        it was saved."""
        modules = [n for n in template if n not in optimizers]
        if len(modules) != 1 or not is_tree_path_layout(target, saved.kind):
            writer = "a Trainer" if saved.kind is not None or os.path.isfile(target) else \
                f"a Trainer, {foreign_writer(target)}"
            entries = sorted({e.split(".")[0] for e in saved.entries})  # DCP flattens its entries' names
            raise CheckpointingError(
                f"checkpoint {target} was written by {writer} (entries {entries}), not by fabric.save; "
                "fabric.load reads a Trainer's torch.save file or DistCheckpointIO directory into a state with exactly "
                f"one module (this state has {modules}); resume this one with trainer.fit(model, ckpt_path=...), or "
                f"load a module's weights with load_module_weights(module, {target!r}) (its entry 'state_dict')")
        layout = rekey_template(source, template, {modules[0]: ModuleEntry("state_dict/", f"{modules[0]}.")},
                                [OptimizerEntry(f"optimizer_states/{i}", template[n])
                                 for i, n in enumerate(optimizers)],
                                ("state_dict/", "optimizer_states/"), self.checkpoint_io.extra_safe_globals)
        layout.optimizer_sources.update({n: ("optimizer_states", i) for i, n in enumerate(optimizers)})
        layout.module_sources[modules[0]] = "state_dict"
        return layout


def apply_loaded(state: Dict[str, Any], loaded: Dict[str, Any], strict: bool,
                 unused: Optional[UnusedWeights] = None) -> Dict[str, Any]:
    """Collective: put each entry of ``loaded`` into the object of ``state`` it belongs to (modules,
    optimizers, stateful objects in place; plain values replaced); returns the entries ``state`` has no
    place for. The outcome is agreed: an object that refuses its value on one rank (a stateful object's
    ``load_state_dict`` raising there, a ``merge_fn`` giving it another shape) fails every rank, not that
    rank alone while the others wait for it in their next collective (``fabric.load``'s barrier). ``unused``:
    the placeholders of a module's weights no rank asked for, refused by its ``load_state_dict``
    (:mod:`.unused_weights`)."""
    return build_on_all_ranks("restore of the loaded state", lambda: _apply_loaded(state, loaded, strict, unused),
                              failed=AFTER_READING)


def _apply_loaded(state: Dict[str, Any], loaded: Dict[str, Any], strict: bool,
                  unused: Optional[UnusedWeights]) -> Dict[str, Any]:
    """:func:`apply_loaded`'s work, on this rank."""
    for name, obj in list(state.items()):
        if name not in loaded:
            continue
        value = loaded.pop(name)
        if isinstance(obj, Module):
            with refusing_placeholders(_unwrap(obj), unused, name, strict):
                _unwrap(obj).load_state_dict(value, strict=strict)
        elif isinstance(obj, Optimizer):
            restore_optimizer(obj, value)
        elif isinstance(obj, _Stateful):
            obj.load_state_dict(value)
        else:
            state[name] = value
    return loaded


FabricDistCheckpointStrategy.register_strategies(STRATEGY_REGISTRY)
