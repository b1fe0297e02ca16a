"""What the Trainer and the Fabric strategies share: the TP x DP grid, its sampler, DDP over the
data-parallel group, and the ``DistCheckpointIO`` they save with.

Both strategies are Lightning's (Trainer's or Fabric's) ``DDPStrategy`` with this mixin first in
their bases; the mixin takes its own two arguments and hands every other one to ``DDPStrategy``.
"""

from __future__ import annotations

import logging
from typing import Any, ContextManager, Dict, List, Optional, Sequence, Set, Type, TypeVar, Union

from lightning.fabric.plugins import CheckpointIO
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel

from ..core.errors import ArgumentError, ArgumentTypeError, CheckpointingError
from ..core.strict import StrictHandling, refusing_unused
from ..reading.checkpoint import CheckpointSource
from ..storage.paths import checkpoint_location
from .checkpoint_io import DistCheckpointIO
from .config import ConfigLike, DistCheckpointConfig, load_checkpoint_config, load_strategy_config
from .model_checkpoint import warn_last_not_found
from .parallel import ParallelState, check_strategy_args, register_strategy_names
from .sharded import build_on_all_ranks, check_describable
from .unused_weights import module_entry_keys

log = logging.getLogger(__name__)

S = TypeVar("S", bound="TensorParallelStrategyMixin")


def dist_checkpoint_io(owner: str, io: Optional[CheckpointIO], config: DistCheckpointConfig) -> DistCheckpointIO:
    """The strategy's plugin: the one given to the Trainer / Fabric, or one made from ``config``.
    Any other CheckpointIO is refused (the strategies' saves are collective and need ours)."""
    if io is None:
        return DistCheckpointIO(config)
    if not isinstance(io, DistCheckpointIO):
        raise ArgumentTypeError(
            f"{owner} needs a DistCheckpointIO checkpoint plugin, got {type(io).__name__} (for background saves "
            "set async_save: true in its config instead of wrapping it)"
        )
    return io


def refusing_module_keys(io: DistCheckpointIO, source: CheckpointSource, entries: Sequence[str],
                         lightning_strict: bool, found: Optional[Set[str]] = None) -> ContextManager[None]:
    """Around a load of ``source`` by ``io``: where the config's ``strict`` is left at its default and
    ``lightning_strict`` (Lightning's ``strict_loading``, Fabric's ``strict``), the checkpoint's keys in the module
    entries ``entries`` that no rank asks for are refused (:func:`~..core.strict.refusing_unused`); else nothing more.
    Every restore of module weights takes it: a durable one (:meth:`DistCheckpointIOMixin._load_modules`) and a
    local tier's (:mod:`.tiers_restore`), so a resume refuses alike whichever tier holds the step. ``found``: the
    refusal is left to the caller, after the user's hooks (:mod:`.unused_weights`); the keys are added there."""
    as_lightning = lightning_strict and io.config.strict is None
    return refusing_unused(module_entry_keys(source, entries, io.extra_safe_globals) if as_lightning else None,
                           found)


class DistCheckpointIOMixin:
    """A strategy whose ``checkpoint_io`` is always a :class:`DistCheckpointIO`: the plugin given to
    the Trainer / Fabric, or one made from the strategy's own ``_checkpoint_config`` (mixed in first,
    before Lightning's strategy class, so this property replaces Lightning's)."""

    _checkpoint_io: Optional[CheckpointIO]  # Lightning's Strategy.__init__ sets it
    _checkpoint_config: DistCheckpointConfig

    @property
    def checkpoint_io(self) -> DistCheckpointIO:
        given = self._checkpoint_io
        self._checkpoint_io = dist_checkpoint_io(type(self).__name__, given, self._checkpoint_config)
        if given is not None and not getattr(self, "_said_plugin_wins", False):
            self._said_plugin_wins = True
            config = self._checkpoint_config
            if config != DistCheckpointConfig() and config != self._checkpoint_io.config:  # settings silently lost
                log.warning("%s: the DistCheckpointIO plugin given to the Trainer / Fabric has its own config, so the "
                            "strategy's checkpoint= settings are not used; give them to the plugin "
                            "(DistCheckpointIO(config)) or drop the plugin", type(self).__name__)
        return self._checkpoint_io

    @checkpoint_io.setter
    def checkpoint_io(self, io: Optional[CheckpointIO]) -> None:
        self._checkpoint_io = io

    def _strict_handling(self) -> StrictHandling:
        """The plugin's strictness, relaxed to logging when the LightningModule asked for
        non-strict loading (``strict_loading = False``). Trainer strategies only."""
        strict = self.checkpoint_io.config.strict_handling
        module = getattr(self, "lightning_module", None)
        if module is not None and not getattr(module, "strict_loading", True) and not strict.skips_unexpected:
            return StrictHandling.LOG_ALL
        return strict

    #: Lightning's strictness refuses a checkpoint's module weights the module does not ask for, as stock DDP's
    #: ``load_state_dict(strict=True)`` does; False where the stock strategy never looks for them (ModelParallel:
    #: DCP reads only the keys the module asks for, so a checkpoint's extra layer is left unread there too).
    refuses_unused_weights = True

    def _strict_loading(self) -> bool:
        """Lightning's ``LightningModule.strict_loading`` (True without a module). Trainer strategies only."""
        return bool(getattr(getattr(self, "lightning_module", None), "strict_loading", True))

    def _load_modules(self, template: Dict[str, Any], source: CheckpointSource, entries: Sequence[str],
                      lightning_strict: bool, found: Optional[Set[str]] = None, **kwargs: Any) -> Dict[str, Any]:
        """Collective: ``checkpoint_io.load_sharded(template, source, **kwargs)``. Where the config's ``strict``
        is left at its default and ``lightning_strict`` (Lightning's ``strict_loading``, Fabric's ``strict``), the
        checkpoint's keys in the module entries ``entries`` that no rank asks for are refused as stock's
        ``load_state_dict(strict=True)`` refuses them (both sides named, on every rank alike); other entries
        keep the mode's handling. A ``strict`` the user set keeps its Megatron-Core meaning. ``found``: those keys
        are added there, refused by the caller after the user's hooks (:mod:`.unused_weights`)."""
        io = self.checkpoint_io
        with refusing_module_keys(io, source, entries, lightning_strict and self.refuses_unused_weights, found):
            return io.load_sharded(template, source, **kwargs)


class SavedTogetherMixin:
    """Leaves out the barrier ``Trainer.save_checkpoint`` makes right after a strategy's collective save
    (mixed in before Lightning's strategy class, whose ``barrier`` it wraps). Every rank met every other
    in the save already: a synchronous save ended with all of them agreeing on its commit
    (``saving/save_commit.finalize_save``), a background one began with all of them agreeing on its plan,
    and the ranks agree on the rest of it (writes, commit) in the background. The barrier would only
    wait for the slowest rank's snapshot, as the next step's collectives do: one collective round less
    per checkpoint, and the caller of an async save waits for its own snapshot only."""

    _SAVE_BARRIER = "Trainer.save_checkpoint"  # the name Lightning's Trainer gives that barrier

    def saving_together(self) -> None:
        """Called as a collective save begins: until :meth:`saved_together`, barriers are barriers."""
        self.__dict__.pop("_saved_together", None)

    def saved_together(self) -> None:
        """Called when a collective save returned on this rank: the next save barrier is left out."""
        self._saved_together = True

    def barrier(self, name: Optional[str] = None) -> None:
        if name == self._SAVE_BARRIER and self.__dict__.pop("_saved_together", False):
            return
        super().barrier(name)  # type: ignore[misc]


class AsyncCommitHooksMixin(DistCheckpointIOMixin):
    """The Trainer hooks that commit background saves (``async_save``) of a Trainer strategy saving
    with :class:`DistCheckpointIO` (mixed in before Lightning's strategy class): a finished save is
    committed at the next step boundary, and the end of training waits for the last one. Saves are
    made in the background only between the start of a run (``setup_environment``) and its
    ``teardown``: one made outside (``trainer.save_checkpoint()`` after ``fit()``, the spawn
    launcher's last weights) would have nothing after it to commit it, so it commits before returning."""

    def setup_environment(self) -> None:
        super().setup_environment()  # type: ignore[misc]
        self.checkpoint_io.background_saves = True

    def _check_checkpoint_dirs(self, trainer: Any) -> None:
        """At setup, not at the first save an epoch later: every ``ModelCheckpoint``'s folder (resolved
        by its own setup, which has run) must be a place we save to (a local path or ``s3://``)."""
        for callback in trainer.checkpoint_callbacks:
            dirpath = getattr(callback, "dirpath", None)
            if dirpath is not None:
                checkpoint_location(dirpath, f"{type(callback).__name__} dirpath")

    def teardown(self) -> None:
        self.checkpoint_io.background_saves = False
        super().teardown()  # type: ignore[misc]  # Strategy.teardown commits a pending save (CheckpointIO.teardown)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Commit a finished async save at the step boundary, without waiting for an unfinished one."""
        super().on_train_batch_start(batch, batch_idx)  # type: ignore[misc]
        self.checkpoint_io.finalize_if_done()

    def on_train_start(self) -> None:
        """Once restored (``trainer.ckpt_path`` final on either side of setup): a fit from scratch beside
        committed last checkpoints that a stock ``ModelCheckpoint`` cannot find for ``"last"`` says so."""
        super().on_train_start()  # type: ignore[misc]
        warn_last_not_found(getattr(self.lightning_module, "_trainer", None))  # type: ignore[attr-defined]

    def on_train_end(self) -> None:
        """The end of training waits for (and commits) the last async save."""
        super().on_train_end()  # type: ignore[misc]
        self.checkpoint_io.wait()


class TensorParallelStrategyMixin(DistCheckpointIOMixin):
    """TP x DP process groups and distributed checkpoints for a Lightning or Fabric ``DDPStrategy``.

    Args:
        tensor_parallel_size: TP ranks per model replica (must divide the world size).
        checkpoint: checkpoint settings (:class:`DistCheckpointConfig`, mapping, or YAML path); a
            ``DistCheckpointIO`` plugin given to the Trainer / Fabric takes precedence.
        ddp_kwargs: the arguments of the ``DDPStrategy`` it is mixed into, except ``process_group`` /
            ``device_mesh`` (the data-parallel group is the strategy's own).
    """

    _ddp_kwargs: Dict[str, Any]

    def __init__(self, tensor_parallel_size: int = 1, checkpoint: Optional[Union[str, Dict[str, Any]]] = None,
                 **ddp_kwargs: Any) -> None:
        tensor_parallel_size = check_strategy_args(type(self).__name__, tensor_parallel_size, ddp_kwargs)
        super().__init__(**ddp_kwargs)
        self.tensor_parallel_size = tensor_parallel_size
        self._checkpoint_config: DistCheckpointConfig = load_checkpoint_config(checkpoint)  # type: ignore[arg-type]
        self._parallel_state: Optional[ParallelState] = None

    @classmethod
    def from_config(cls: Type[S], cfg: ConfigLike, **kwargs: Any) -> S:
        """Build from a strategy config (``tensor_parallel_size`` and a ``checkpoint:`` section), e.g.
        ``configs/strategy_tp2.yaml``."""
        given = sorted({"tensor_parallel_size", "checkpoint"} & set(kwargs))
        if given:  # was a raw TypeError (multiple values); the config's value and the argument may differ
            raise ArgumentError(f"{cls.__name__}.from_config(cfg, {given[0]}=...): {given[0]} is a setting of the "
                                f"strategy config; give it there, or build {cls.__name__}({given[0]}=...) instead")
        sc = load_strategy_config(cfg)
        return cls(tensor_parallel_size=sc.tensor_parallel_size, checkpoint=sc.checkpoint, **kwargs)  # type: ignore[arg-type]

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Lightning's / Fabric's registration hook: ``strategy="ddp_distckpt"`` (and ``"ddp_distckpt_spawn"``)."""
        register_strategy_names(cls, strategy_registry)

    # -- process groups ------------------------------------------------------------------
    @property
    def parallel_state(self) -> ParallelState:
        """This rank's place in the TP x DP grid and its process groups (after environment setup)."""
        if self._parallel_state is None:
            raise CheckpointingError(
                f"{type(self).__name__}.parallel_state is available once the strategy has set up its environment "
                "(Trainer: from LightningModule.configure_model / setup on; Fabric: after fabric.launch())"
            )
        return self._parallel_state

    def setup_environment(self) -> None:
        self.checkpoint_io  # fail early (before any process group exists) on a foreign CheckpointIO
        super().setup_environment()  # type: ignore[misc]  # initializes torch.distributed
        self._parallel_state = ParallelState.build(self.tensor_parallel_size)
        log.debug("%s: %s", type(self).__name__, self._parallel_state.describe())

    @property
    def distributed_sampler_kwargs(self) -> Dict[str, Any]:
        """Dataloaders shard over the DP group: the ranks of one TP group see the same data."""
        ps = self.parallel_state
        return {"num_replicas": ps.dp_size, "rank": ps.dp_rank}

    def _data_parallel_ddp(self, module: Module, device_ids: Optional[List[int]]) -> DistributedDataParallel:
        """DDP over the data-parallel group only: TP shards are neither averaged across TP ranks nor
        overwritten by DDP's initial broadcast. At TP 1 that group is the whole world: DDP is then given
        the default group, as stock DDP is, which is what lets it be copied or pickled (DDP refuses any
        other group), e.g. by a ``deepcopy`` of callbacks that hold the trainer."""
        ps = self.parallel_state
        group = ps.dp_group if ps.tp_size > 1 else None
        return DistributedDataParallel(module=module, device_ids=device_ids, process_group=group, **self._ddp_kwargs)

    def _check_describable(self, module: Module) -> None:
        """At setup, not at the first save: a tensor-parallel module must describe its shards.
        Collective (every rank sets up): a refusal on any rank raises on every rank."""
        ps = self.parallel_state
        build_on_all_ranks(f"{type(self).__name__} setup of {type(module).__name__}",
                           lambda: check_describable(module, ps))

