"""Restoring a Trainer checkpoint under :class:`~lightning_distckpt.lightning.DistCheckpointStrategy` at the
points where stock Lightning restores each part.

Stock DDP restores the module's weights and the callbacks' state before the strategy's setup, so
``on_fit_start`` hooks see them (a resumed ``Timer`` checks its budget there), and the loops,
optimizers and schedulers after it (``restore_training_state``). The strategy loads the sharded
optimizer state in place, into optimizers that exist only after setup, so it reads the checkpoint
(opened once) in two parts:

1. :func:`load_before_setup`, Lightning's ``load_checkpoint`` (``restore_checkpoint_after_setup`` is
   False): the module's shards and every entry but the optimizer state, which is left as a
   :class:`DeferredOptimizerStates` under ``"optimizer_states"``.
2. :func:`restore_after_setup`, from Lightning's ``load_optimizer_state_dict``: the optimizer state,
   in place.

Each part is read from a view of the checkpoint holding only its own keys, so the key checks of the
configured ``strict`` handling name what each part misses, not what the other part reads.
"""

from __future__ import annotations

import copy
import logging
import os
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Set

from ..core.errors import CheckpointingError, MissingKeysError
from ..core.strict import StrictHandling, check_keys, deferring_absent
from .foreign import WEIGHTS_ADVICE, WEIGHTS_ONLY, fabric_writer, foreign_advice, foreign_writer
from .restore_source import RestoreSource
from .sharded import build_on_all_ranks, describe_source, restore_optimizers_agreed
from .stock import (REST_KEY, ModuleEntry, OptimizerEntry, SavedCheckpoint, StoredLayout, is_tree_path_layout,
                    place_stored_tensors, rekey_template, restore_param_keys)
from .tree import KIND_MODEL_PARALLEL, KIND_SHARDED, without_manifest
from .unused_weights import UnusedWeights, hold_absent, insert_placeholders, module_templates, placeholders

if TYPE_CHECKING:
    from .strategy import DistCheckpointStrategy

log = logging.getLogger(__name__)

OPTIMIZER_ENTRY = "optimizer_states"
#: Lightning's words (``_CheckpointConnector.restore_optimizers_and_schedulers``) for the same case.
MODEL_ONLY = ("Trying to restore optimizer state but checkpoint contains only the model. This is probably due to "
              "`ModelCheckpoint.save_weights_only` being set to `True`.")


class ModelOnlyCheckpointError(MissingKeysError):
    """``fit(ckpt_path=...)`` of a checkpoint saved with ``save_weights_only``: Lightning's own message."""


def is_optimizer_key(key: str) -> bool:
    """A stored key of the optimizer state: ours (``optimizer_states.0.state...``) or by tree path
    (``optimizer_states/0/state/...``: a ``torch.save`` file, the plugin's and the ModelParallel
    strategy's directories)."""
    return key.startswith((f"{OPTIMIZER_ENTRY}.", f"{OPTIMIZER_ENTRY}/"))


def view(source: RestoreSource, keep: Callable[[str], bool]) -> RestoreSource:
    """``source`` showing only the stored keys ``keep`` accepts, in its index and in every field of
    its ``metadata.json`` keyed by stored keys; the same opened checkpoint and the same common state
    (read once, shared)."""
    out = copy.copy(source)
    index = source.index
    out.index = replace(index, tensors={k: v for k, v in index.tensors.items() if keep(k)},
                        objects={k: v for k, v in index.objects.items() if keep(k)})
    meta = getattr(source, "meta", None)
    if isinstance(meta, dict):
        stored = set(index.tensors) | set(index.objects)
        out.meta = {field: {k: v for k, v in value.items() if keep(k)}
                    if isinstance(value, dict) and value and set(value) <= stored else value
                    for field, value in meta.items()}
    return out


@dataclass
class DeferredOptimizerStates:
    """What ``load_checkpoint`` leaves under ``checkpoint["optimizer_states"]``: the optimizer state
    is read into the optimizers by ``load_optimizer_state_dict``, once they exist (after setup).
    ``source`` None: the checkpoint holds none, and a non-strict resume keeps the fresh optimizers."""

    path: str
    source: Optional[RestoreSource]
    stored: int  # optimizer states the checkpoint holds
    by_path: bool  # stored by tree path (a torch.save file, the plugin's or ModelParallel's directory)
    by_name: bool  # their state keyed by parameter name (DistCheckpointModelParallelStrategy)

    def __repr__(self) -> str:
        return (f"DeferredOptimizerStates({self.stored} optimizer state(s) of {self.path}, read by "
                "DistCheckpointStrategy.load_optimizer_state_dict once the optimizers exist)")


def check_writer(path: str, saved: SavedCheckpoint) -> bool:
    """Refuse what a Trainer under this strategy cannot resume; True when tensors are stored by tree
    path (a ``torch.save`` file, or a directory of the plugin / the ModelParallel strategy)."""
    by_path = is_tree_path_layout(path, saved.kind) or saved.kind == KIND_MODEL_PARALLEL
    if saved.kind != KIND_SHARDED and not by_path:
        writer = foreign_writer(path) if saved.kind is None else f"by a writer of kind {saved.kind!r}"
        raise CheckpointingError(f"checkpoint {path} was written {writer}, not by DistCheckpointStrategy, "
                                 f"DistCheckpointIO or torch.save. {foreign_advice(path)}")
    if saved.kind is None and not saved.entries and os.path.isfile(path):  # tensors alone: a state dict's file
        raise CheckpointingError(f"checkpoint {path} {WEIGHTS_ONLY}. {WEIGHTS_ADVICE}")
    if not saved.by_trainer and (saved.kind is not None or "pytorch-lightning_version" not in saved.entries):
        raise CheckpointingError(
            f"checkpoint {path} was written {fabric_writer(saved.kind)} (entries {sorted(saved.entries)}), "
            "not by a Trainer; load it with fabric.load, or a module's weights in one process with "
            f"load_module_weights(module, {path!r}, entry=<its entry>)")
    return by_path


def load_before_setup(strategy: "DistCheckpointStrategy", path: str, fitting: bool) -> Dict[str, Any]:
    """Collective: the module's shards read in place, every other entry but the optimizer state
    whole; ``"optimizer_states"`` deferred (:class:`DeferredOptimizerStates`) when fitting."""
    restore_optimizers = fitting and strategy.lightning_restore_optimizer
    strict = strategy._strict_handling()
    extra = strategy.checkpoint_io.extra_safe_globals

    def build() -> Any:
        source = strategy.checkpoint_io.open_source(path)
        saved = describe_source(source, extra)
        by_path = check_writer(path, saved)
        weights = view(source, lambda key: not is_optimizer_key(key))
        template: Dict[str, Any] = {"state_dict": strategy._model_ssd()}
        if by_path:  # tensors named by their path in Lightning's dict
            layout = rekey_template(weights, template, {"state_dict": ModuleEntry("state_dict/", "")}, [],
                                    ("state_dict/", f"{OPTIMIZER_ENTRY}/"), extra)
        else:
            layout = StoredLayout(template, {})
        return source, weights, layout, by_path, saved.kind == KIND_MODEL_PARALLEL

    source, weights, layout, by_path, by_name = build_on_all_ranks(f"load from {path}", build)
    found: Set[str] = set()  # the module weights no rank asks for: refused after the user's hooks, as stock does
    held: Set[str] = set()  # the module's keys the checkpoint lacks, where it has such weights: checked after them
    dp_group = strategy.parallel_state.dp_group
    # found under strict_loading = False too: a hook may rename them onto the module's keys (left unused, logged)
    with deferring_absent(held):
        loaded = strategy._load_modules(layout.template, weights, ["state_dict"], True, found, strict=strict,
                                        data_parallel_group=dp_group)
    # named from the manifest before it leaves the common state; the same on every rank (found over the load's
    # key exchange): alike everywhere
    unused = placeholders(weights, found, "state_dict", extra) if found else {}
    if REST_KEY in layout.template:
        loaded = place_stored_tensors(loaded, layout, path)
    loaded = without_manifest(loaded, path)  # its dicts' keys in the saved order, as torch.load gives them

    def read(entry: str, template: Dict[str, Any]) -> Dict[str, Any]:  # collective: a placeholder a hook moved
        return strategy.checkpoint_io.load_sharded({entry: template}, weights, strict=StrictHandling.
                                                   ASSUME_OK_UNEXPECTED, data_parallel_group=dp_group)[entry]
    strategy._unused_weights = UnusedWeights(path, read=read,
                                             templates=module_templates(layout.template, ["state_dict"]))
    insert_placeholders(strategy._unused_weights, "state_dict", loaded["state_dict"], unused)
    hold_absent(strategy._unused_weights, loaded, held,
                lambda keys: check_keys(strict, path, (), keys, keys, unasked=set(found)),
                strict=not strict.skips_unexpected)
    # A new top level: the optimizer part of the common state stays as read, for the second read.
    checkpoint = dict(loaded)
    stored = checkpoint.pop(OPTIMIZER_ENTRY, None)
    if not restore_optimizers:
        return checkpoint
    if stored is None and not strict.skips_unexpected:  # refused after the weights, as stock orders it
        raise ModelOnlyCheckpointError(f"{MODEL_ONLY} (checkpoint {path}; a non-strict load, strict: log_all, "
                                       "starts the optimizers afresh)")
    if stored is None:  # non-strict: fresh optimizers and schedulers
        log.warning("checkpoint %s holds only the model; the optimizers and LR schedulers start afresh (non-strict)",
                    path)
        checkpoint.setdefault("lr_schedulers", [])  # Lightning zips them with the schedulers: none restored
        checkpoint[OPTIMIZER_ENTRY] = DeferredOptimizerStates(path, None, 0, by_path, by_name)
        return checkpoint
    count = len(stored) if isinstance(stored, (list, tuple, dict)) else 1
    checkpoint[OPTIMIZER_ENTRY] = DeferredOptimizerStates(path, view(source, is_optimizer_key), count, by_path, by_name)
    return checkpoint


def restore_after_setup(strategy: "DistCheckpointStrategy", deferred: DeferredOptimizerStates) -> None:
    """Collective: read the optimizer state ``load_before_setup`` left for now into the optimizers."""
    source, path = deferred.source, deferred.path
    deferred.source = None  # read once; the opened checkpoint is not kept past the restore
    optimizers = strategy._raw_optimizers()
    if source is None or deferred.stored == 0:  # nothing stored (e.g. optimizer_states={}): as stock, none restored
        return
    if deferred.stored != len(optimizers):
        raise CheckpointingError(f"checkpoint {path} has {deferred.stored} optimizer states, the module has "
                                 f"{len(optimizers)} optimizers")
    extra = strategy.checkpoint_io.extra_safe_globals

    def build() -> StoredLayout:
        model_ssd = strategy._model_ssd()
        template: Dict[str, Any] = {OPTIMIZER_ENTRY: strategy._optimizer_states(model_ssd)}
        if not deferred.by_path:
            return StoredLayout(template, {})
        entries = [OptimizerEntry(f"{OPTIMIZER_ENTRY}/{i}", s, deferred.by_name)
                   for i, s in enumerate(template[OPTIMIZER_ENTRY])]
        return rekey_template(source, template, {}, entries, ("state_dict/", f"{OPTIMIZER_ENTRY}/"), extra)

    layout = build_on_all_ranks(f"load of the optimizer state from {path}", build)
    loaded = strategy.checkpoint_io.load_sharded(layout.template, source, strict=strategy._strict_handling(),
                                                 data_parallel_group=strategy.parallel_state.dp_group)
    states: List[Dict[str, Any]] = loaded[OPTIMIZER_ENTRY]
    if deferred.by_path:
        states = [restore_param_keys(s, s["param_keys"], path) for s in states]
    restore_optimizers_agreed(f"restore of the optimizer state from {path}", optimizers, states)
