"""Checkpoint tiers in a Fabric loop: :class:`FabricTiers` saves the state to the node-local tier
every ``local_every_n_steps`` and restores the newest recoverable step of any tier (docs/tiers.md).

    fabric = Fabric(devices=4, strategy=FabricDistCheckpointStrategy(checkpoint={"tiers": {...}}))
    fabric.launch()
    model, optimizer = fabric.setup(model, optimizer)
    tiers = FabricTiers(fabric)                               # collective
    state = {"model": model, "optimizer": optimizer, "step": 0}
    tiers.restore(state, durable=[(1000, "ckpt/step1000")])   # in place; None: nothing to restore
    for step in range(state["step"], total):
        ...                                                   # one optimizer step
        state["step"] = step + 1
        tiers.save(state, step + 1)                           # a local save when due
        if (step + 1) % 1000 == 0:
            fabric.save(f"ckpt/step{step + 1}", state)        # the durable tier, as before
    tiers.wait()
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Sequence, Tuple

from lightning.fabric.wrappers import (_FabricDataLoader, _FabricModule, _FabricOptimizer, _unwrap_compiled,
                                       _unwrap_objects)
from torch.nn import Module
from torch.optim import Optimizer

from ..core.errors import ArgumentError, CheckpointingError, MissingKeysError
from ..core.strict import StrictHandling
from ..tiers import LocalTier, RecoveryPoint, TierOptions
from .fabric import apply_loaded
from .unused_weights import UnusedWeights
from .model_parallel import drop_unsaved_states
from .sharded import build_on_all_ranks, optimizer_sharded_state
from .tiers_restore import load_like_durable, moved_reader, read_durable
from .tree import MANIFEST_KEY


class FabricTiers:
    """The node-local tier of a Fabric job under ``FabricDistCheckpointStrategy`` or
    ``FabricDistCheckpointModelParallelStrategy`` (collective: every rank makes one, after
    ``fabric.launch()`` and ``fabric.setup``).

    Args:
        fabric: the launched Fabric.
        options: the tiers' settings; default: the ``tiers:`` section of the strategy's checkpoint config.
        run: this run's name, the same at every restart of it (your experiment's name or id; rank 0's is
            taken): only local steps saved under it are restored, never those another job left on the
            same ``local_dir``. None: every local step counts, whichever job saved it.
    """

    def __init__(self, fabric: Any, options: Optional[TierOptions] = None, run: Optional[str] = None) -> None:
        strategy = fabric.strategy
        if not callable(getattr(strategy, "sharded_state", None)):
            raise CheckpointingError("FabricTiers needs FabricDistCheckpointStrategy or "
                                     f"FabricDistCheckpointModelParallelStrategy, got {type(strategy).__name__}")
        options = options if options is not None else strategy.checkpoint_io.config.tier_options
        if options is None:
            raise ArgumentError("FabricTiers: no options given and the strategy's checkpoint config has no "
                                "tiers: section")
        self.strategy = strategy
        self.options = options
        self.tier = LocalTier(options, run=run)
        self._last_step = -1

    def save(self, state: Dict[str, Any], step: int) -> bool:
        """Collective: when ``step`` is a multiple of ``local_every_n_steps`` (and not saved yet), the
        tree ``fabric.save`` would write for ``state``, handed to the local tier; returns once it is
        snapshotted (True), or at once when no save is due (False)."""
        if step % self.options.local_every_n_steps or step == self._last_step:
            return False
        self.tier.begin(step)  # the node's oldest step removed while the tree is built
        tree = self.strategy.sharded_state(_unwrap_objects(state), what=f"local tier step {step}")
        self.tier.save(tree, step=step)
        self._last_step = step
        return True

    def restore(self, state: Dict[str, Any], durable: Sequence[Tuple[int, str]] = (),
                strict: bool = True) -> Optional[RecoveryPoint]:
        """Collective: the newest step of any tier (this node's, a partner's copy, or one of the
        ``durable`` checkpoints ``(step, path)`` that ``fabric.save`` wrote) loaded into ``state`` in
        place, as ``fabric.load`` would (``strict`` as there); returns where from, or None (``state``
        untouched) when nothing is recoverable."""
        point = self.tier.recoverable(durable, files=True)  # a torch.save file too: _restore reads it as fabric.load
        if point is None:
            return None
        # As fabric.save / fabric.load see it: Fabric's wrappers removed (the keys fabric.save writes), plain
        # values copied back into the caller's dict afterwards.
        unwrapped = _unwrap_objects(state)
        point = self._restore(unwrapped, point, strict)
        for name in list(unwrapped):
            obj, _ = _unwrap_compiled(state[name])
            if not isinstance(obj, (_FabricModule, _FabricOptimizer, _FabricDataLoader)):
                state[name] = unwrapped[name]
        return point

    def _restore(self, state: Dict[str, Any], point: RecoveryPoint, strict: bool) -> RecoveryPoint:
        """Collective: ``point`` loaded into ``state`` (unwrapped objects); the point actually read."""
        if point.source == "durable":
            assert point.path is not None
            self.strategy.load_checkpoint(point.path, state, strict=strict)
            return point
        model_parallel = callable(getattr(self.strategy, "state_template", None))
        dtensors: Dict[Any, Any] = {}
        build = (lambda: self.strategy.state_template(state, dtensors)) if model_parallel else \
            (lambda: self._template(state))
        template = build_on_all_ranks(f"load of local step {point.step}", build)
        io = self.strategy.checkpoint_io
        handling = io.config.strict_handling if strict else StrictHandling.LOG_ALL

        def adjust(template: Dict[str, Any], stored: Any) -> None:  # as fabric.load does (a non-strict one)
            drop_unsaved_states(template, [(n,) for n, obj in state.items() if isinstance(obj, Optimizer)], stored,
                                dtensors)

        def durable_reader(durable: RecoveryPoint) -> None:  # every local copy damaged: read as fabric.load reads it
            self.strategy.load_checkpoint(durable.path, state, strict=strict)

        fits = model_parallel and handling.skips_unexpected
        read_from = [point]  # the step read: another where every local copy of this one was damaged
        # refused by load_state_dict after the user's hooks, as fabric.load's; named alike on every rank (each
        # reads its node's copy); none where the strategy, as its stock one, leaves those weights unread
        unused = None if model_parallel else UnusedWeights(f"local step {point.step}",
                                                           read=moved_reader(io, self.tier, read_from),
                                                           lenient="fabric.load(..., strict=False)")
        # fabric.load's search for the module weights no rank asks for, on the same entries: with ``unused``
        # found however strict (a hook may rename them, else refused or logged there)
        refuses = (strict or unused is not None) and getattr(self.strategy, "refuses_unused_weights", True)
        modules = ([name for name, obj in state.items() if isinstance(obj, Module)], refuses)
        out = load_like_durable(io, self.tier, template, point, handling, adjust=adjust if fits else None,
                                durable_reader=durable_reader, modules=modules, unused=unused)
        point = read_from[0] = self.tier.last_point or point
        if read_durable(self.tier):  # its checkpoint (a torch.save file, say) restored as fabric.load restores it
            return point
        loaded = dict(out)
        if model_parallel:  # FabricDistCheckpointModelParallelStrategy: DTensors, torch's state-dict API
            self.strategy.apply_state(state, loaded, dtensors, handling, strict, f"local step {point.step}")
            return point
        loaded.pop(MANIFEST_KEY, None)
        absent = [name for name in state if name not in loaded]
        if strict and absent:  # as fabric.load refuses them
            raise MissingKeysError(f"local step {point.step}: has no entry {absent} (restore with strict=False to "
                                   "skip them)")
        apply_loaded(state, loaded, strict, unused)
        return point

    def _template(self, state: Dict[str, Any]) -> Dict[str, Any]:
        """The state's modules and optimizers, sharded as the strategy saves them."""
        modules = self.strategy._module_ssds(state)
        template: Dict[str, Any] = dict(modules.by_name)
        for name, obj in state.items():
            if isinstance(obj, Optimizer):
                template[name] = optimizer_sharded_state(obj, modules.params, name, init_state=True)
        return template

    def wait(self) -> None:
        """Collective: finish the local save in flight and its partner copies (raises what failed)."""
        self.tier.wait()

    def close(self) -> None:
        """Finish what is in flight; the tier is unusable afterwards."""
        self.tier.close()
