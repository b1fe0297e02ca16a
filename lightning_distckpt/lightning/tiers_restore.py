"""``fit(ckpt_path="last")`` with tiers: the ranks agree on the newest recoverable step
(:meth:`LocalTier.recoverable`, given the durable ``last*.ckpt`` checkpoints found) and restore it,
in the same two parts as any restore (:mod:`.trainer_restore`): the module and every entry but the
optimizer state before setup, the optimizer state in place once the optimizers exist. A durable
point is restored by the usual path; a local one is read by :meth:`LocalTier.load` (own node's tier,
a partner's copy over torch.distributed, or durable storage, shard by shard)."""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

from ..core.errors import CheckpointingError, IncompleteCheckpointError
from ..core.dtensors import restore_dtensor
from ..core.state_dict import merge, split_common
from ..core.strict import StrictHandling, check_keys, deferring_absent
from ..planning.load_plan import allowing_shape_mismatch
from ..tiers import LocalTier, RecoveryPoint
from ..tiers.recover import DurableReader
from .sharded import build_on_all_ranks, restore_optimizers_agreed
from .tiers import durable_candidates, tier_callback
from .tp_strategy import refusing_module_keys
from .unused_weights import UnusedWeights, hold_absent, insert_placeholders, module_templates, placeholders
from .trainer_restore import OPTIMIZER_ENTRY, is_optimizer_key, load_before_setup, view
from .tree import without_manifest

if TYPE_CHECKING:
    from .model_parallel import DistCheckpointModelParallelStrategy
    from .strategy import DistCheckpointStrategy

log = logging.getLogger(__name__)
#: Fits a load's template to the stored tensor keys of the checkpoint it reads (in place).
Adjust = Callable[[Dict[str, Any], Any], None]
#: A restore's module entries in the checkpoint and Lightning's strictness for them (``strict_loading``,
#: ``fabric.load``'s ``strict``): as a durable restore hands them to ``_load_modules``.
Modules = Tuple[Sequence[str], bool]

@dataclass
class DeferredTierOptimizerStates:
    """What the restore of a local point leaves under ``checkpoint["optimizer_states"]``: read into
    the optimizers by ``load_optimizer_state_dict`` once they exist."""

    tier: LocalTier
    point: RecoveryPoint
    stored: int  # optimizer states the checkpoint holds

    def __repr__(self) -> str:
        return f"DeferredTierOptimizerStates({self.stored} optimizer state(s) of local step {self.point.step})"

    def restore(self, strategy: "DistCheckpointStrategy") -> None:
        """Collective: the optimizer state of the local point, in place."""
        optimizers = strategy._raw_optimizers()
        if self.stored != len(optimizers):
            raise CheckpointingError(f"local checkpoint of step {self.point.step} has {self.stored} optimizer "
                                     f"states, the module has {len(optimizers)} optimizers")
        if not optimizers:
            return

        def build() -> Dict[str, Any]:
            return {OPTIMIZER_ENTRY: strategy._optimizer_states(strategy._model_ssd())}

        template = build_on_all_ranks(f"load of the optimizer state of local step {self.point.step}", build)
        loaded = tier_load(strategy, self.tier, template, self.point, keep=is_optimizer_key)
        restore_optimizers_agreed(f"restore of the optimizer state of local step {self.point.step}", optimizers,
                                  loaded[OPTIMIZER_ENTRY])


def tier_load(strategy: Any, tier: LocalTier, template: Dict[str, Any], point: RecoveryPoint,
              keep: Optional[Callable[[str], bool]] = None, adjust: Optional[Adjust] = None,
              durable_reader: Optional[DurableReader] = None, modules: bool = False,
              unused: Optional[UnusedWeights] = None) -> Dict[str, Any]:
    """Collective :func:`load_like_durable` with the strategy's load settings; ``modules``: the load reads the
    module's weights (Lightning's ``state_dict`` entry, under the module's ``strict_loading``)."""
    # with ``unused``, found however strict (as a durable restore finds them): a hook may rename them (else logged)
    strict = (strategy._strict_loading() or unused is not None) and strategy.refuses_unused_weights
    scope = (["state_dict"], strict) if modules else None
    return load_like_durable(strategy.checkpoint_io, tier, template, point, strategy._strict_handling(), keep, adjust,
                             durable_reader, scope, unused)


def read_durable(tier: LocalTier) -> bool:
    """Whether the latest load of ``tier`` read a durable point (through its ``durable_reader``, whose value it
    returned as it is): every local copy of the agreed step was found damaged, or the point was durable."""
    return tier.last_point is not None and tier.last_point.source == "durable"


def moved_reader(io: Any, tier: LocalTier, read_from: List[RecoveryPoint],
                 keep: Optional[Callable[[str], bool]] = None) -> Callable[[str, Dict[str, Any]], Dict[str, Any]]:
    """:attr:`UnusedWeights.read` of a local-tier restore: a collective read of the placeholders a hook moved,
    from ``read_from[0]`` (the step the restore read: set again where every copy of the first was damaged)."""
    def read(entry: str, moved: Dict[str, Any]) -> Dict[str, Any]:
        return load_like_durable(io, tier, {entry: moved}, read_from[0], StrictHandling.ASSUME_OK_UNEXPECTED,
                                 keep)[entry]
    return read


def load_like_durable(io: Any, tier: LocalTier, template: Dict[str, Any], point: RecoveryPoint,
                      handling: StrictHandling, keep: Optional[Callable[[str], bool]] = None,
                      adjust: Optional[Adjust] = None, durable_reader: Optional[DurableReader] = None,
                      modules: Optional[Modules] = None, unused: Optional[UnusedWeights] = None) -> Any:
    """Collective :meth:`LocalTier.load` of ``template``, read as ``io.load_sharded`` reads a durable
    checkpoint, so that a local point restores exactly what the same checkpoint would restore from durable
    storage: ``handling`` as it is, the config's ``allow_shape_mismatch`` and ``cast``, and, for a non-strict
    load, the template's own common values where the checkpoint has none. ``keep``: the stored keys this part
    of a restore sees (a durable restore's view of its part: each part's key checks name what it misses, not
    the other part's keys). ``adjust(template, stored_tensor_keys)``: the template fitted to the checkpoint
    read (:func:`~.model_parallel.drop_unsaved_states`), before each read. ``durable_reader``: the strategy's own
    restore of a durable point the load falls back to (every local copy damaged); its value is returned as it is
    (:func:`read_durable` says so), as ``ckpt_path=<that checkpoint>`` would have restored it. ``modules``: the
    module entries and Lightning's strictness, refusing the point's module weights no rank asks for as the durable
    restore refuses them (:func:`~.tp_strategy.refusing_module_keys`, the same on every rank); ``unused``: that
    refusal left to the module's ``load_state_dict``, after the user's hooks, as the durable one (placeholders put
    into the loaded module entries and recorded there, the module's keys the copy lacks held until the hooks ran,
    :mod:`.unused_weights`)."""
    loaded_into = allowing_shape_mismatch(template) if io.config.allow_shape_mismatch else template
    fallback: List[Any] = [None]
    scopes = contextlib.ExitStack()  # the refusal of the copy read, set as it is opened, for its load
    found: Optional[Set[str]] = set() if unused is not None else None
    held: Set[str] = set()  # the module's keys the copy lacks, where it has unused weights: checked after the hooks
    opened: List[Any] = [None]

    def prepare(source: Any) -> Any:
        if keep is not None:
            source = view(source, keep)
        if modules is not None:  # from the copy's metadata and common state: the same keys on every rank
            opened[0] = source
            scopes.enter_context(refusing_module_keys(io, source, *modules, found))
        for tree in {id(t): t for t in (template, loaded_into)}.values():
            if adjust is not None:
                adjust(tree, source.index.tensors)
        # From the template itself, as load_sharded takes it: the optimizer's restore tells its own values
        # (a tuple of parameters without state) from the checkpoint's by identity; a copy is not its own.
        fallback[0] = split_common(template)[1] if handling.skips_unexpected else None
        return source

    with scopes, deferring_absent(held) if found is not None else contextlib.nullcontext():
        # a later copy's refusal (another after damage) replaces the first's; a durable_reader sets its own scopes
        out = tier.load(loaded_into, point, prepare=prepare, durable_reader=durable_reader, strict=handling,
                        extra_safe_globals=io.extra_safe_globals, cast=io.config.cast)
    if durable_reader is not None and read_durable(tier):
        return out
    loaded = out[0] if isinstance(out, tuple) else out
    loaded = merge(fallback[0], loaded) if isinstance(fallback[0], dict) else loaded
    for entry in modules[0] if found and modules is not None else ():
        if isinstance(loaded.get(entry), dict):  # named from the copy's manifest, still in its common state
            insert_placeholders(unused, entry, loaded[entry], placeholders(opened[0], found, entry,
                                                                           io.extra_safe_globals))
    if unused is not None and modules is not None:  # as the durable restore: the absent keys wait for the hooks
        unused.templates = module_templates(template, modules[0])
        hold_absent(unused, loaded, held, lambda keys: check_keys(handling, unused.path, (), keys, keys,
                                                                  unasked=set(found or ())),
                    strict=not handling.skips_unexpected)
    return loaded


def durable_step(strategy: Any, path: str) -> Optional[int]:
    """The global step a durable checkpoint was saved at (its common state's ``global_step``); None
    for one that cannot say (logged: it is then not a candidate)."""
    try:
        common = strategy.checkpoint_io.open_source(path).load_common(strategy.checkpoint_io.extra_safe_globals)
        step = common.get("global_step") if isinstance(common, dict) else None
    except (CheckpointingError, OSError) as e:  # not ours to resume, or gone since it was listed
        log.warning("tiers: durable checkpoint %s is not a candidate: %s", path, e)
        return None
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def agree_on_point(strategy: Any, marker: str) -> Tuple[LocalTier, RecoveryPoint]:
    """Collective: Lightning resolved ``ckpt_path="last"`` to the tiers' ``marker``; the Trainer's
    local tier and the newest step recoverable from any tier (the durable ``last*.ckpt`` included)."""
    assert strategy.lightning_module is not None
    trainer = strategy.lightning_module.trainer
    callback = tier_callback(trainer)
    if callback is None or callback.local_tier is None:
        raise CheckpointingError(f"ckpt_path resolved to the tiers marker {marker}, but the Trainer has no "
                                 "TierCheckpoint set up (configure tiers: in the strategy's checkpoint config)")
    tier = callback.local_tier
    started = time.perf_counter()
    # rank 0's list decides (LocalTier.recoverable): the other ranks need not read every candidate's
    # common state (cold, from durable storage) only to have it ignored
    durable = durable_candidates(trainer, lambda path: durable_step(strategy, path)) if trainer.global_rank == 0 else []
    point = tier.recoverable(durable, files=True)  # a stock .ckpt too: the strategy's durable restore reads it
    if point is None:
        raise IncompleteCheckpointError(
            f'ckpt_path="last": local saves were made here ({marker}) but no step is recoverable: every copy of '
            f"some shard of the local checkpoints is gone and no durable last checkpoint was found "
            f"({len(durable)} candidate(s)). Remove {marker} to start from scratch, or pass a checkpoint path.")
    log.info("tiers: resuming from step %d (%s%s); agreed in %.3f s (%d durable candidate(s))", point.step,
             point.source, f" {point.path}" if point.path else f", local tier {tier.options.local_dir}",
             time.perf_counter() - started, len(durable))
    return tier, point


def load_recovery_point(strategy: "DistCheckpointStrategy", marker: str, fitting: bool) -> Dict[str, Any]:
    """Collective, before setup (DistCheckpointStrategy): the agreed point restored, the optimizer
    state deferred until the optimizers exist when fitting."""
    tier, point = agree_on_point(strategy, marker)
    if point.source == "durable":
        assert point.path is not None
        return load_before_setup(strategy, point.path, fitting)
    return load_local_before_setup(strategy, tier, point, fitting and strategy.lightning_restore_optimizer)


def load_model_parallel_recovery(strategy: "DistCheckpointModelParallelStrategy", marker: str) -> Dict[str, Any]:
    """Collective, after setup (DistCheckpointModelParallelStrategy restores there): the agreed point
    read into the model's and optimizers' DTensors; returns the rest of the checkpoint."""
    from .model_parallel import drop_unsaved_states, put_value, value_at  # it imports this module

    tier, point = agree_on_point(strategy, marker)
    if point.source == "durable":
        assert point.path is not None
        return strategy.load_checkpoint(point.path)
    optimizers = strategy._raw_optimizers()
    dtensors: Dict[Any, Any] = {}
    template = build_on_all_ranks(f"load of local step {point.step}", lambda: strategy.template(optimizers, dtensors))

    def adjust(template: Dict[str, Any], stored: Any) -> None:  # as the durable load does (a non-strict one)
        entries = [("optimizer_states", i) for i in range(len(template.get("optimizer_states", [])))]
        drop_unsaved_states(template, entries, stored, dtensors)

    fits = strategy._strict_handling().skips_unexpected
    # Every local copy damaged: the durable checkpoint restored as ckpt_path=<it> restores it (any layout).
    out = tier_load(strategy, tier, template, point, adjust=adjust if fits else None,
                    durable_reader=lambda durable: strategy.load_checkpoint(durable.path), modules=True)
    if read_durable(tier):
        return out
    loaded = without_manifest(dict(out), f"local step {point.step}")
    for where, dt in dtensors.items():  # the loaded local shards, back in their DTensors
        put_value(loaded, where, restore_dtensor(dt, value_at(loaded, where)))
    return strategy.set_states(loaded, optimizers)


def load_local_before_setup(strategy: "DistCheckpointStrategy", tier: LocalTier, point: RecoveryPoint,
                            restore_optimizers: bool) -> Dict[str, Any]:
    """Collective: the module's shards of a local point read in place, every other entry whole; the
    optimizer state deferred (:class:`DeferredTierOptimizerStates`) when restoring optimizers."""
    template = build_on_all_ranks(f"load of local step {point.step}", lambda: {"state_dict": strategy._model_ssd()})
    # Every local copy damaged: the durable checkpoint restored as ckpt_path=<it> restores it (a torch.save file, the
    # plugin's directory, a weights-only one: re-keyed, its writer checked, its optimizer state deferred as there).
    # load_before_setup restores the optimizers when fitting and the strategy restores them: as restore_optimizers.
    def keep(key: str) -> bool:  # the weights' part, in both reads below
        return not is_optimizer_key(key)
    read_from: List[RecoveryPoint] = [point]
    # named alike on every rank (each reads its node's copy)
    unused = UnusedWeights(f"local step {point.step}", read=moved_reader(strategy.checkpoint_io, tier, read_from, keep))
    out = tier_load(strategy, tier, template, point, keep=keep,
                    durable_reader=lambda durable: load_before_setup(strategy, str(durable.path), restore_optimizers),
                    modules=True, unused=unused)
    if read_durable(tier):
        return out
    strategy._unused_weights = unused  # refused by load_model_state_dict, after the user's hooks
    checkpoint = dict(out)
    point = read_from[0] = tier.last_point or point  # another step where every local copy of this one was damaged
    checkpoint = without_manifest(checkpoint, f"local step {point.step}")  # in the saved key order
    stored = checkpoint.pop(OPTIMIZER_ENTRY, None)
    if restore_optimizers:
        count = len(stored) if isinstance(stored, (list, tuple, dict)) else 0
        checkpoint[OPTIMIZER_ENTRY] = DeferredTierOptimizerStates(tier, point, count)
    return checkpoint
