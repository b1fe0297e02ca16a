"""Recovery: agree on the newest recoverable step, then load it from each rank's own node.

:func:`recoverable` gathers every node's checked holdings (:mod:`.holdings`) and picks the newest save
whose every rank store some node of the current job holds; rank 0 checks the durable checkpoints newer
than that, newest first, and the newer of the two wins (the local one at equal steps).

:func:`load_local` completes each node's copy with what its ranks' load reads (:mod:`.fetch`: from the
partners, over torch.distributed), then runs the ordinary collective ``lightning_distckpt.load`` on each
rank's own node directory, resharding as any load. Its loader is ``"every_rank"`` unless the caller
names another (each rank reads its own pieces, from its node's memory or disk: an exchange loader would
have ranks read for each other, so every node would need every store).

A restore loads one point in parts (Lightning: the module, then the optimizer state). The first
:func:`load_local` of a point remembers (:class:`ReadyCopy`, per tier and step, forgotten at the next
save) which stores this node's completed, checked copy holds; a later load of the point whose every rank
reads only stores its node holds skips the listing, the checks and the fetch (one small all-gather
decides, so every rank takes the same path) and goes straight to the load; the loads of a copy share one
opening of it and one read of its common state (:class:`~lightning_distckpt.reading.shared_source.SharedCopy`).

A damaged local copy (a chunk failing its checksum as the load reads it) is never used: the failed load
is retried from another copy, an older step or durable storage, agreed by every rank (:func:`load_local`,
:mod:`.damage`); nothing is read twice when nothing is damaged.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable, Dict, FrozenSet, List, NamedTuple, Optional, Set, Tuple

from lightning_distckpt.core.errors import ArgumentError, CheckpointingError, IncompleteCheckpointError
from lightning_distckpt.reading.shared_source import SharedCopy
from lightning_distckpt.storage.layout import METADATA_FILE, parse_json
from lightning_distckpt.storage.paths import METADATA_CAP, read_inside
from lightning_distckpt.storage.stores import open_store
from lightning_distckpt.tiers.context import TierContext
from lightning_distckpt.tiers.damage import Damage, find_damage
from lightning_distckpt.tiers.fetch import complete_local_copy
from lightning_distckpt.tiers.holdings import StepInfo, newest_complete, scan_node
from lightning_distckpt.tiers.needs import needed_writers
from lightning_distckpt.tiers.options import RecoveryPoint

logger = logging.getLogger(__name__)

EVERY_RANK = "every_rank"
#: A caller's step before each read of a point (:func:`prepared`): given the opened checkpoint, it may adjust the
#: template in place for what the checkpoint stores and returns the source to read (it, or a view of it).
Prepare = Callable[[Any], Any]
Durable = List[Tuple[int, str]]  # (step, location) of durable checkpoints
#: A caller's own restore of a durable point (its strategy's ``ckpt_path=<that checkpoint>``): where a load falls
#: back to a durable checkpoint, it is read as that restore reads it (re-keyed, its writer checked, ...).
DurableReader = Callable[[RecoveryPoint], Any]
#: Load failures that say the request does not fit the checkpoint, never that its bytes are damaged.
NOT_DAMAGE = frozenset({"MissingKeysError", "ArgumentError", "ArgumentTypeError", "ConfigError"})


def gather_holdings(ctx: TierContext, error: Optional[Exception] = None) -> List[StepInfo]:
    """Collective: every node's checked holdings (listed by its lead), the same list on every rank;
    ``error`` (this rank's bad argument, say) is raised on every rank instead. With a ``run`` (the
    tier's), only the steps that run saved: another job's, on the same root before this one, are not ours
    to resume (nor are steps that record no run)."""
    mine: List[StepInfo] = []
    if ctx.is_lead and error is None:
        try:
            mine = [i for i in scan_node(ctx.root, ctx.node) if ctx.run is None or i.run == ctx.run]
        except Exception as e:  # agreed: every rank raises the same
            error = e
    gathered = ctx.comm.agree("local tier: listing the local checkpoints failed", error, mine)
    return [info for part in gathered for info in part]


def recoverable(ctx: TierContext, durable: Any,
                files: bool = False) -> Tuple[Optional[RecoveryPoint], List[StepInfo], Durable]:
    """Collective: the newest recoverable step (see the module docstring; rank 0's ``durable`` list
    decides, a malformed list is an ArgumentError on every rank), the holdings it was chosen from
    (the same on every rank: the load that follows needs not list and check them again) and the
    durable checkpoints checked (rank 0's; the load's fallback when every local copy is damaged). ``files``: a
    durable checkpoint that is a file (a ``torch.save`` ``.ckpt``) counts; only a caller whose ``durable_reader``
    reads it (a Trainer's or Fabric's restore) may say so: ``lightning_distckpt.load`` reads directories."""
    checked: Durable = []
    try:
        checked = _check_durable(durable)
    except ArgumentError as e:
        gather_holdings(ctx, e)  # agreed: raised on every rank
        raise
    holdings = gather_holdings(ctx)
    return decide(ctx, holdings, checked, files), holdings, checked


def decide(ctx: TierContext, holdings: List[StepInfo], durable: Durable,
           files: bool = False) -> Optional[RecoveryPoint]:
    """Collective: the newest save of ``holdings`` every store of which some node holds, or a newer
    durable checkpoint of rank 0's ``durable`` (checked by rank 0, newest first); the same on every rank."""
    best = newest_complete(holdings)
    local_step = best[0].step if best else None
    error: Optional[Exception] = None
    found: Optional[Tuple[int, str]] = None
    if ctx.rank == 0:
        try:
            found = _newest_durable(durable, local_step, files)
        except Exception as e:
            error = e
    found = ctx.comm.agree("local tier: checking the durable checkpoints failed", error, found)[0]
    if found is not None:
        return RecoveryPoint(found[0], "durable", found[1])
    return RecoveryPoint(local_step, "local") if local_step is not None else None


def _check_durable(durable: Any) -> List[Tuple[int, str]]:
    """``durable`` as a list of (step >= 0, location); ArgumentError naming what is wrong."""
    try:
        pairs = list(durable)
    except TypeError:
        raise ArgumentError(f"recoverable: durable must be a sequence of (step, location), got {durable!r}") from None
    out = []
    for item in pairs:
        if (not isinstance(item, (tuple, list)) or len(item) != 2 or isinstance(item[0], bool)
                or not isinstance(item[0], int) or item[0] < 0 or not isinstance(item[1], (str, os.PathLike))):
            raise ArgumentError(f"recoverable: each durable checkpoint must be (step >= 0, location), got {item!r}")
        out.append((item[0], os.fspath(item[1])))
    return out


def _newest_durable(durable: List[Tuple[int, str]], newer_than: Optional[int],
                    files: bool = False) -> Optional[Tuple[int, str]]:
    """The newest committed durable checkpoint with a step above ``newer_than`` (its metadata checked; with
    ``files``, a file counts as it is: a ``torch.save`` file has no commit marker, its reader checks it)."""
    for step, location in sorted(durable, key=lambda d: d[0], reverse=True):
        if newer_than is not None and step <= newer_than:
            return None
        if files and os.path.isfile(location):
            return (int(step), str(location))
        try:
            open_store(location).open_metadata()
        except CheckpointingError:
            continue
        return (int(step), str(location))
    return None


class ReadyCopy(NamedTuple):
    """This node's copy of one step, completed and checked by an earlier load of it."""

    path: str
    held: FrozenSet[int]  # the writers whose stores it holds
    whole: bool  # it holds every writer's store: any load of it reads only what it holds
    meta: Any  # its parsed metadata.json (None: unreadable, so no load skips the checks)
    opened: SharedCopy  # the copy as every load of it opens it: once, its common state read once


def _ready_for(ctx: TierContext, ready: Optional[ReadyCopy], template: Dict[str, Any], every_rank: bool) -> bool:
    """Collective: whether every rank's load of ``template`` reads only stores its node's ready copy holds."""
    ok = False
    if ready is not None and every_rank and ready.whole:
        ok = True  # no need to plan this rank's reads (as costly as the load's own planning)
    elif ready is not None and every_rank and isinstance(ready.meta, dict):
        need = needed_writers(template, ready.meta, ready.path, ctx.rank)
        ok = need is not None and need <= ready.held
    return all(ctx.comm.agree("local tier: checking this node's copy failed", None, ok))


class LocalCopy(NamedTuple):
    """This node's copy of a step, ready for the load: where, the writers whose stores it holds, and
    its opener shared by every load of it."""

    path: str
    held: FrozenSet[int]
    opened: SharedCopy


def _local_copy(ctx: TierContext, step: int, template: Dict[str, Any], ready: Dict[int, ReadyCopy],
                holdings: Optional[List[StepInfo]], every_rank: bool) -> LocalCopy:
    """Collective: this node's copy of ``step`` completed (unless ``ready`` says an earlier load of it
    did), remembered in ``ready``."""
    known = ready.get(step)
    if known is not None and _ready_for(ctx, known, template, every_rank):
        return LocalCopy(known.path, known.held, known.opened)
    path, held, writers = complete_local_copy(ctx, step, holdings if holdings is not None else gather_holdings(ctx),
                                              template if every_rank else None)
    whole = writers <= held
    # Stores fetched for this load join the same copy (its metadata and common state unchanged, each load's
    # reader opens the stores anew): the opening stays shared. After damage the copy's note is gone: opened anew.
    opened = known.opened if known is not None and known.path == path else SharedCopy(path)
    ready[step] = ReadyCopy(path, held, whole, None if whole else _metadata(path), opened)
    return LocalCopy(path, held, opened)


def load_local(ctx: TierContext, point: RecoveryPoint, sharded_state_dict: Dict[str, Any],
               process_group: Any, load_kwargs: Dict[str, Any], ready: Dict[int, ReadyCopy],
               holdings: Optional[List[StepInfo]] = None, durable: Optional[Durable] = None,
               prepare: Optional[Prepare] = None,
               durable_reader: Optional[DurableReader] = None) -> Tuple[Any, RecoveryPoint]:
    """Collective: complete this node's copy of ``point`` (unless ``ready`` says an earlier load of it
    did: then it is remembered there), then the ordinary load from it; returns what the load returns
    and the point it read. ``holdings``: those :func:`recoverable` just gathered (the same on every
    rank), else they are gathered again.

    A load that fails on some ranks (agreed, so every rank knows which) has the stores their nodes hold
    checked (:func:`.damage.find_damage`); with damaged ones found, the holdings are listed again without
    them and the load retried: the same step from another copy, else (only with ``durable``, the first
    load after :func:`recoverable`: nothing of the point was restored yet) the newest step still
    recoverable, local or durable. Without damage found, the load's own error is raised. ``prepare``: see
    :func:`prepared`, before each read (of another point too, after damage). ``durable_reader``: reads a
    durable point instead of the plain load (and returns what it returns): a durable ``last.ckpt`` may be of
    another layout (a ``torch.save`` file, ...) that only the strategy's own restore reads as it should."""
    from lightning_distckpt.serialization import load

    every_rank = load_kwargs.get("loader", EVERY_RANK) == EVERY_RANK
    seen: Set[Tuple[str, str, int, Optional[str]]] = set()  # (node, step directory, writer, fetched from)
    while True:
        if point.source == "durable" and durable_reader is not None:
            return durable_reader(point), point
        if point.source == "durable":
            durable_target: Any = point.path if prepare is None else prepared(ctx, SharedCopy(point.path), prepare)
            return load(sharded_state_dict, durable_target, process_group=process_group, **load_kwargs), point
        copy = _local_copy(ctx, point.step, sharded_state_dict, ready, holdings, every_rank)
        # The copy's shared opener: the parts of a restore open it and unpickle its common state once.
        target: Any = copy.opened if not {"key_map", "storage"} & set(load_kwargs) else copy.path
        try:
            if prepare is not None:  # before the load: the template it reads into may change. Agreed, and
                target = prepared(ctx, copy.opened, prepare)  # a copy too damaged to open falls back below
            out = load(sharded_state_dict, target, process_group=process_group,
                       **{"loader": EVERY_RANK, **load_kwargs})
            return out, point
        except CheckpointingError as e:
            # Not agreed over the ranks: no collective may follow. A request the checkpoint cannot serve
            # (keys, arguments) is no damage: nothing is read back for it.
            if not e.failures or all(f.type_name in NOT_DAMAGE for f in e.failures.values()):
                raise
            error = e
        ready.pop(point.step, None)
        damage = find_damage(ctx, copy.path, copy.held, error.failures)
        new = {(d.node, d.path, d.writer, d.fetched_from) for d in damage} - seen
        if not new:  # nothing (new) damaged: the load failed for another reason
            raise error
        seen |= new
        holdings = gather_holdings(ctx)  # listed again: the damaged stores' notes are gone
        point = _next_point(ctx, point, holdings, durable, damage, error, durable_reader is not None)


class _Prepared(SharedCopy):
    """A load's target already opened, as the caller's ``prepare`` chose it."""

    def __init__(self, path: str, source: Any) -> None:
        super().__init__(path)
        self._opened = source


def prepared(ctx: TierContext, opened: SharedCopy, prepare: Prepare) -> SharedCopy:
    """Collective: ``prepare`` of the opened checkpoint (the load's target); where it fails on any rank, every
    rank raises it, before anything is read. So a restore treats a point as a durable restore treats its
    checkpoint (the template fitted to the stored keys, a part's view of them) before the load plans."""
    source: Any = None
    error: Optional[Exception] = None
    try:
        source = prepare(opened())
    except Exception as e:  # agreed below: no rank enters the load alone
        error = e
    ctx.comm.agree(f"local tier: preparing the load of {opened.path} failed", error)
    return _Prepared(opened.path, source)


def _next_point(ctx: TierContext, point: RecoveryPoint, holdings: List[StepInfo], durable: Optional[Durable],
                damage: List[Damage], error: CheckpointingError, files: bool = False) -> RecoveryPoint:
    """Collective: where a load retries after ``damage`` (see :func:`load_local`); the same on every rank."""
    what = "; ".join(f"node {d.node}: rank {d.writer}'s store ({d.problem})" for d in damage[:3])
    if durable is not None:
        new = decide(ctx, holdings, durable, files)  # files: a durable_reader reads them
    else:
        new = point if newest_complete(holdings, step=point.step) is not None else None
    if new is None:
        raise IncompleteCheckpointError(
            f"local tier: step {point.step}: damaged local copies ({what}) and no intact copy of every store of "
            + ("it, no older local step and no durable checkpoint left" if durable is not None
               else "it left (part of it was already restored: no fallback to another step)")) from error
    if ctx.rank == 0:
        logger.warning("local tier: step %d: damaged local copies (%s): loading %s instead", point.step, what,
                       f"step {new.step} from {new.source}" + (f" {new.path}" if new.path else " copies"))
    return new


def _metadata(path: str) -> Any:
    """The parsed ``metadata.json`` of a local copy; None when it cannot be read (the load will say why)."""
    try:
        return parse_json(read_inside(os.path.join(path, METADATA_FILE), METADATA_FILE, max_bytes=METADATA_CAP), path)
    except (OSError, CheckpointingError):
        return None
