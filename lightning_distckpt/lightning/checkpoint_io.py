"""``DistCheckpointIO``: Lightning's CheckpointIO plugin writing distributed checkpoint directories.

Two ways in:

* the stock ``CheckpointIO`` API (``save_checkpoint`` / ``load_checkpoint`` / ``remove_checkpoint``),
  for any Lightning strategy that saves from global rank 0 only (stock DDP, single device). It never
  enters a collective: the process saves alone, as a group of one, so other ranks can never hang on
  it; each tensor is stored whole and loads under any world size.
* the collective API (``save_sharded`` / ``load_sharded``) used by
  :class:`~lightning_distckpt.lightning.DistCheckpointStrategy` and
  :class:`~lightning_distckpt.lightning.FabricDistCheckpointStrategy`, where every rank takes part.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import fields, replace
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO
from lightning_utilities.core.apply_func import apply_to_collection

from ..comm import Comm, get_comm
from ..core.dtensors import shard_dtensors
from ..core.errors import (ArgumentError, ArgumentTypeError, CheckpointingError, CheckpointNotFoundError, FormatError,
                           IncompleteCheckpointError)
from ..core.megatron_leaves import from_megatron_leaves
from ..core.state_dict import merge, split_common
from ..core.strict import StrictHandling
from ..serialization import load as dist_load, save as dist_save
from ..reading.checkpoint import CheckpointSource, open_checkpoint
from ..reading.loaders import DEFAULT_LOADER, EveryRankLoader, Loader, TwoStageDataParallelLoader, resolve_loader
from ..logs import attach_to_lightning
from ..planning.load_plan import allowing_shape_mismatch
from ..reading.pipeline import with_cast
from ..storage.committed import committed_inside
from ..storage.paths import checkpoint_location
from ..storage.stores import open_store
from ..reading.formats.files import check_torch_payload
from ..storage.safe_pickle import load_file
from ..storage.tensorstore_io import StorageOptions
from ..saving.async_pending import finish_saves_to
from ..saving.async_save import AsyncSaver, AsyncSaveRequest
from ..saving.background_snapshot import Selector
from ..saving.save import SavePlanCache, prepare_save, write_and_commit
from .config import ConfigLike, DistCheckpointConfig, load_checkpoint_config, unknown_argument
from .last_link import links_to_target, repoint_last_links
from .plugin_strategy_check import tell_strategy
from .fabric_checkpoint import fabric_checkpoint
from .foreign import NOT_FOUND_ADVICE, TRAINER_RESUMES_NEWEST, foreign_advice, foreign_writer, refuse_file_inside
from .restore_source import RestoreSource
from .slurm_requeue import is_requeue_save
from .stock import open_torch_file, tensors_metadata
from .tree import (KIND_MODEL_PARALLEL, KIND_PLAIN, KIND_SHARDED, MANIFEST_KEY, manifest, plain_to_sharded,
                   template_from_manifest, torch_optimizer_states, without_manifest)

logger = logging.getLogger(__name__)

#: This process alone, whether or not torch.distributed is initialized: no collective is entered.
LOCAL = Comm(None, 0, 1)
#: What Lightning's ``TorchCheckpointIO`` says of a checkpoint path with nothing at it.
LIGHTNING_NOT_FOUND = "Checkpoint file not found"


@contextlib.contextmanager
def lightning_not_found(path: Any) -> Iterator[None]:
    """A missing checkpoint raised in the block gets Lightning's words first, with the path as given (``Checkpoint
    file not found: last.ckpt``): code written for ``TorchCheckpointIO`` matches them; ours and what to do follow."""
    try:
        yield
    except CheckpointNotFoundError as e:
        if str(e).startswith(LIGHTNING_NOT_FOUND):  # a nested block said it already
            raise
        raise CheckpointNotFoundError(f"{LIGHTNING_NOT_FOUND}: {path}; {e}; {NOT_FOUND_ADVICE}") from None


class DistCheckpointIO(CheckpointIO):
    """Saves Lightning checkpoints as distributed checkpoint directories.

    ``Trainer(plugins=[DistCheckpointIO()])`` with the stock DDP strategy or ``strategy="auto"``;
    ``DistCheckpointStrategy`` uses one by default (pass your own to configure it).

    Args:
        config: a :class:`DistCheckpointConfig`, a mapping with its keys, or a YAML file
            (``configs/checkpoint.yaml``); unknown keys raise :class:`ConfigError` naming them.
        extra_safe_globals: further trusted types that the checkpoint's common state may hold
            (loading never unpickles anything else); the config's ``safe_globals`` adds more by name.

    Loading is always safe (``weights_only``-style): ``weights_only`` is accepted for the
    CheckpointIO signature, and ``False`` does not widen what may be unpickled.
    """

    def __init__(self, config: ConfigLike = None, extra_safe_globals: Sequence[Any] = (), **unknown: Any) -> None:
        if unknown:  # DistCheckpointIO(async_save=True): say where a setting goes, not Python's TypeError
            raise ArgumentError(unknown_argument("DistCheckpointIO", *next(iter(unknown.items())),
                                                 ["config", "extra_safe_globals"], "({{{key!r}: {value!r}}})"))
        super().__init__()
        self.config: DistCheckpointConfig = load_checkpoint_config(config)
        self.extra_safe_globals = tuple(extra_safe_globals) + self.config.safe_global_types
        self._saver: Optional[AsyncSaver] = None  # made on the first async save, local or collective
        self._pending: Optional[AsyncSaveRequest] = None
        self._linked_before: List[str] = []  # links to the pending save's target: a failure repoints only newer
        # Synchronous collective saves reuse the last validated plan when no rank's layout changed
        # (one round trip instead of the records' gather and the plans' scatter; async saves: the saver's).
        self._plan_cache = SavePlanCache(self.extra_safe_globals)
        self._deferred_removals: List[str] = []  # asked for during a background save (old top-k): done once it commits
        self.step_boundary_commits = 0  # background saves committed by finalize_if_done
        # Our strategies turn background saves off between their teardown and their next run: a save
        # then (trainer.save_checkpoint() after fit, the spawn launcher's last weights) has no later
        # save, load or teardown to commit it, so it commits before returning.
        self.background_saves = True
        attach_to_lightning()  # our INFO lines (one per save / load) print as Lightning's own do

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)
        attach_to_lightning()  # a spawned process's copy of the plugin

    def __getstate__(self) -> Dict[str, Any]:
        """A copy (``torch.save(trainer)``, ``deepcopy``, the spawn launcher) keeps the settings; the
        save in flight (a thread, a lock, a process group) and its deferred removals stay here."""
        state = dict(self.__dict__)
        state.update(_saver=None, _pending=None, _deferred_removals=[],
                     _plan_cache=SavePlanCache(self.extra_safe_globals))
        return state

    @classmethod
    def from_config(cls, cfg: ConfigLike, **kwargs: Any) -> "DistCheckpointIO":
        """Build from ``cfg``: a YAML path, a mapping or a :class:`DistCheckpointConfig`; ``kwargs``: as the class's."""
        if "config" in kwargs:  # was a raw TypeError (multiple values), which of the two meant unsaid
            raise ArgumentError("DistCheckpointIO.from_config(cfg, config=...): the settings come from cfg; give them "
                                "once (DistCheckpointIO(config=...) takes them as well)")
        return cls(load_checkpoint_config(cfg), **kwargs)

    # -- the stock CheckpointIO API (one process saves) -------------------------------------
    def save_checkpoint(self, checkpoint: Dict[str, Any], path: Any, storage_options: Optional[Any] = None) -> None:
        """Save a Lightning checkpoint dict to the directory ``path``, from this process alone.

        ``storage_options`` may be a :class:`StorageOptions` or a mapping of some of its fields, overriding the
        configured ones for this save. With ``async_save`` the :class:`AsyncSaver` snapshots the tensors and writes
        them in the background, as a group of one; the next save, load or teardown commits it (or raises its error).
        """
        target = checkpoint_location(path, "path")
        tell_strategy(self, "save", target)  # a strategy that cannot resume what we write: said once
        self.wait()
        storage = self._storage(storage_options)
        tree = plain_to_sharded(checkpoint)
        tree[MANIFEST_KEY] = manifest(tree, KIND_PLAIN)
        if self._in_background(target):
            self._snapshot_not_in_background()
            self._linked_before = links_to_target(target)
            self._pending = self._async_saver().save(
                tree, target, validate_access_integrity=self.config.validate_access_integrity, balance_writes=False,
                storage=storage, comm=LOCAL)
        else:
            self._save_local(tree, target, storage)

    def load_checkpoint(self, path: Any, map_location: Optional[Any] = None,
                        weights_only: Optional[bool] = None) -> Dict[str, Any]:
        """Read a whole checkpoint in this process (any world size wrote it): every tensor whole,
        in its place; tensors land on the CPU unless ``map_location`` (a device or str) says otherwise.
        A ``torch.save`` file (a stock Lightning ``.ckpt``) is read as it is, safely (``weights_only``)."""
        self.wait()
        target = checkpoint_location(path, "path")
        finish_saves_to(target)  # a background save of this process (another plugin's) commits first
        kind: Optional[str] = None
        if os.path.isfile(target):  # a stock Lightning / Fabric torch.save file, read safely
            refuse_file_inside(target)
            state = load_file(target, self.extra_safe_globals)
            check_torch_payload(target, state)  # no meta / sparse tensor handed out as data
        else:
            with lightning_not_found(path):
                state, kind = self._load_directory(target)
        if map_location is not None:
            if not isinstance(map_location, (str, torch.device)):
                raise ArgumentTypeError(f"map_location must be a device or a str for distributed checkpoints, "
                                        f"got {map_location!r}")
            state = apply_to_collection(state, torch.Tensor, lambda t: t.to(map_location))
        return fabric_checkpoint(state, target, kind)

    def _load_directory(self, target: str) -> Tuple[Dict[str, Any], Optional[str]]:
        """The checkpoint directory read whole, and its manifest's kind (opened and read once)."""
        source = self.open_source(target)
        common = source.load_common(self.extra_safe_globals)
        man = common.get(MANIFEST_KEY) if isinstance(common, dict) else None
        if man is None:
            raise FormatError(f"checkpoint {target} was written {foreign_writer(target)}: not a Lightning "
                              f"checkpoint (no {MANIFEST_KEY} manifest). {foreign_advice(target)}")
        template = template_from_manifest(man, tensors_metadata(source), target)
        state, _, _ = EveryRankLoader().load(template, source, LOCAL, StrictHandling.ASSUME_OK_UNEXPECTED,
                                             self.extra_safe_globals)
        state = without_manifest(state, target)
        # The strategies key optimizer state by parameter name; a stock strategy restores torch's layout.
        kind = man.get("kind")
        return (torch_optimizer_states(state) if kind in (KIND_SHARDED, KIND_MODEL_PARALLEL) else state), kind

    def open_source(self, path: Any) -> "RestoreSource":
        """The checkpoint at ``path`` opened for one restore (its metadata parsed now, once; a ``torch.save`` file
        unpickled once), to pass to :meth:`load_sharded` after checking what it holds: its common state read once."""
        target = checkpoint_location(path, "path")
        finish_saves_to(target)
        refuse_file_inside(target)
        opened = open_torch_file(target, self.extra_safe_globals)
        if opened is not None:  # the tensors' typed paths, which a re-keyed template needs, come with it
            return RestoreSource(*opened)
        try:
            return RestoreSource(open_checkpoint(target, extra_safe_globals=self.extra_safe_globals))
        except IncompleteCheckpointError as e:
            if isinstance(e, CheckpointNotFoundError) or not committed_inside(target):
                raise
            # the core's error names the checkpoints inside already; a Trainer has a shorter way
            raise IncompleteCheckpointError(f"{e} {TRAINER_RESUMES_NEWEST}") from None

    def remove_checkpoint(self, path: Any) -> None:
        """Remove a checkpoint directory (or the link ``save_last="link"`` made, not its target); an
        ``s3://`` checkpoint: its commit marker, then its versions (``ModelCheckpoint``'s top-k)."""
        target = checkpoint_location(path, "path")
        tell_strategy(self, "remove", target)  # a strategy that saves without us (ModelCheckpoint rotates its files)
        if self._pending is not None:
            self._deferred_removals.append(target)
            logger.debug("removal of %s deferred until the background save commits", target)
            return
        open_store(target).remove()  # its store's way: a directory, a link, or a marker and its versions
        logger.debug("removed checkpoint %s", target)

    def teardown(self) -> None:
        """Wait for a background save (and raise its error)."""
        self.wait()

    # -- the collective API (every rank calls) ---------------------------------------------
    def save_sharded(self, sharded_state_dict: Dict[str, Any], path: Any,
                     process_group: Optional[dist.ProcessGroup] = None,
                     storage_options: Optional[Any] = None, background_snapshot: Selector = False) -> None:
        """Collective save of ``sharded_state_dict`` (each rank its own shards) to ``path`` over ``process_group``;
        ``storage_options``: StorageOptions or a mapping of its fields (None: the config's). ``background_snapshot``:
        what a background save's thread copies (:meth:`AsyncSaver.save`; the caller waits on ``pending``)."""
        self.wait()
        kwargs: Dict[str, Any] = dict(
            process_group=process_group,
            validate_access_integrity=self.config.validate_access_integrity,
            balance_writes=self.config.balance_writes,
            storage=self._storage(storage_options),
        )
        if self._in_background(str(path)):
            if background_snapshot is False:  # the caller waits at no step
                self._snapshot_not_in_background()
            # finalize() (collective) runs before the next save/load/teardown: on every rank at the same point
            self._linked_before = links_to_target(str(path)) if not dist.is_initialized() or dist.get_rank() == 0 \
                else []
            self._pending = dist_save(sharded_state_dict, path, async_save=self._async_saver(),
                                      background_snapshot=background_snapshot, **kwargs)
        else:
            dist_save(sharded_state_dict, path, plan_cache=self._plan_cache, **kwargs)

    def load_sharded(self, template: Dict[str, Any], path: Union[str, "os.PathLike[str]", CheckpointSource],
                     process_group: Optional[dist.ProcessGroup] = None,
                     strict: Union[StrictHandling, str, None] = None,
                     data_parallel_group: Optional[dist.ProcessGroup] = None) -> Dict[str, Any]:
        """Collective load into ``template`` over ``process_group``; returns the loaded tree merged with the common
        state. ``path``: a checkpoint path, or a source already open (:meth:`open_source`, on every rank). ``strict``:
        None for the config's. ``data_parallel_group``: this rank's DP group, for the ``two_stage`` loader."""
        self.wait()
        handling = StrictHandling.parse(self.config.strict_handling if strict is None else strict)
        loader: Union[str, Loader, None] = self.config.loader
        if (self.config.loader or DEFAULT_LOADER) == "two_stage" and data_parallel_group is not None:
            # Read each chunk once per data-parallel group, broadcast within it.
            loader = TwoStageDataParallelLoader(data_parallel_group=data_parallel_group)
        # The template's own common values (e.g. a fresh optimizer's scalar step) fill in for what a
        # non-strict load finds missing; the checkpoint's values win wherever it has them.
        _, fallback = split_common(template) if handling.skips_unexpected else (None, None)
        if self.config.allow_shape_mismatch:
            template = allowing_shape_mismatch(template)
        if isinstance(path, CheckpointSource):
            loaded = load_from_source(template, with_cast(path, self.config.cast), process_group, handling,
                                      self.extra_safe_globals, loader)
        else:
            out = dist_load(template, path, process_group=process_group, strict=handling,
                            extra_safe_globals=self.extra_safe_globals, loader=loader, cast=self.config.cast)
            loaded = out[0] if isinstance(out, tuple) else out
        return merge(fallback, loaded) if isinstance(fallback, dict) else loaded

    @property
    def pending(self) -> Optional[AsyncSaveRequest]:
        """The background save in flight (written or not, not yet committed), if any."""
        return self._pending

    def finalize_if_done(self) -> bool:
        """Finish a pending save whose background commit is done (local), or, for a save committed
        by its caller (collective), commit it if every rank's writes have finished; never blocks on
        unfinished ones. Returns whether nothing is pending now. The strategy calls it at each
        training-step boundary."""
        if self._pending is None:
            return True
        pending = self._pending
        # A failed background commit is left to the next save, on_train_end or teardown (every rank at the
        # same point): each rank's thread ends at its own moment, and raised here the failure would stop
        # one rank at this step while the others wait for it in the step's collectives. poll: sparse round trips.
        if not (pending.done() and not pending.failed() if pending.commits_in_background else pending.poll()):
            return False
        self.wait()
        self.step_boundary_commits += 1
        return True

    # -- helpers -------------------------------------------------------------------------
    def wait(self) -> None:
        """Finish a background save; raises its error. Collective when the pending save was collective.

        Removals deferred during the save run after it committed; if it failed they are dropped,
        so the previous checkpoints survive. Interrupted (Ctrl-C) before the save's outcome is known,
        the save stays pending and the removals deferred, for the next wait (Lightning's teardown after
        the interrupt): neither is forgotten."""
        removals, self._deferred_removals = self._deferred_removals, []
        if self._pending is not None:
            pending, self._pending = self._pending, None
            try:
                pending.finalize()  # raises on failure: the deferred removals are dropped
            except CheckpointingError:
                if pending.checkpoint_dir and (not dist.is_initialized() or dist.get_rank() == 0):
                    # save_last="link" linked it when it was issued
                    repoint_last_links(pending.checkpoint_dir, self._linked_before)
                raise
            except BaseException:
                if not pending.finalized:  # interrupted while waiting for the writes: the outcome is still to come
                    self._pending = pending
                    self._deferred_removals = removals + self._deferred_removals
                raise
        for target in removals:
            self.remove_checkpoint(target)

    def prepare_background_saves(self, comm: Comm) -> None:
        """Collective over ``comm`` (the group the saves will use), at the start of a run that saves
        in the background: make the saver and its commit group now, not in the first save."""
        if self._in_background():
            self._async_saver().make_commit_group(comm)

    def reserve_staging(self, nbytes: int, on_accelerator: bool) -> None:
        """Local: allocate the staging pool for a save expected to stage ``nbytes`` on this rank (``on_accelerator``:
        from an accelerator), its pages faulted in ahead of the first save, which otherwise pays them."""
        if self._in_background():
            self._async_saver().reserve_staging(nbytes, on_accelerator)

    def _snapshot_not_in_background(self) -> None:
        """``background_snapshot`` asked of a save whose caller waits at no step (a stock strategy): said once."""
        if self.config.background_snapshot and not self.__dict__.get("_told_snapshot"):
            self._told_snapshot = True
            logger.warning("background_snapshot: only our strategies copy in the background (they wait before "
                           "the optimizer step); this save copies before returning")

    def _in_background(self, target: Optional[str] = None) -> bool:
        """Whether a save (to ``target``) writes in the background: not Lightning's SLURM requeue checkpoint."""
        background = self.config.async_save and self.background_saves
        if background and target is not None and is_requeue_save(target):
            logger.info("save to %s: Lightning's SLURM requeue checkpoint, written before the save returns", target)
            return False
        return background

    def _async_saver(self) -> AsyncSaver:
        if self._saver is None:
            # Names held while in flight: ModelCheckpoint picks its -vN names by what exists.
            # The background thread commits too (a group of the saver's own): the training's step
            # boundaries only look at the thread, with no round trip and no commit on their thread.
            self._saver = AsyncSaver(reserve_targets=True, max_staging_bytes=self.config.max_staging_bytes,
                                     commit_in_background=True)
            self._saver.plan_cache = SavePlanCache(self.extra_safe_globals)  # the types our loads allow
        return self._saver

    def _storage(self, storage_options: Optional[Any]) -> StorageOptions:
        if storage_options is None:
            return self.config.storage_options
        if isinstance(storage_options, StorageOptions):
            return storage_options
        if isinstance(storage_options, Mapping):
            # Only the fields named change: the configured ones (pack_max_bytes, data_file_bytes, ...) stay.
            unknown = sorted(set(storage_options) - {f.name for f in fields(StorageOptions)})
            if unknown:
                raise ArgumentError(f"storage_options: unknown StorageOptions field(s) {unknown}")
            try:
                return replace(self.config.storage, **storage_options)
            except ValueError as e:
                raise ArgumentError(f"storage_options: {e}") from None
        raise ArgumentTypeError(
            f"storage_options must be StorageOptions or a mapping of its fields, got {type(storage_options).__name__}")

    def _save_local(self, tree: Dict[str, Any], target: str, storage: StorageOptions) -> None:
        """The save path with a group of one: no collective, whatever the other ranks do."""
        prep = prepare_save(tree, target, LOCAL, validate_access_integrity=self.config.validate_access_integrity,
                            balance_writes=False, options=storage, plan_cache=self._plan_cache)
        write_and_commit(prep)


def load_from_source(template: Dict[str, Any], source: CheckpointSource, process_group: Optional[dist.ProcessGroup],
                     strict: StrictHandling, extra_safe_globals: Sequence[Any],
                     loader: Union[str, Loader, None]) -> Dict[str, Any]:
    """Collective: :func:`lightning_distckpt.load` of ``template`` from a source every rank opened."""
    tree = shard_dtensors(from_megatron_leaves(template))
    state, _, _ = resolve_loader(loader).load(tree, source, get_comm(process_group), strict, extra_safe_globals)
    return state
