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
decides, so every rank takes the same path) and goes straight to the load.
"""

from __future__ import annotations

import os
from typing import Any, Dict, FrozenSet, List, NamedTuple, Optional, Tuple

from lightning_distckpt.core.errors import ArgumentError, CheckpointingError
from lightning_distckpt.storage.layout import METADATA_FILE, parse_json
from lightning_distckpt.storage.paths import read_inside
from lightning_distckpt.storage.stores import open_store
from lightning_distckpt.tiers.context import TierContext
from lightning_distckpt.tiers.fetch import complete_local_copy
from lightning_distckpt.tiers.holdings import StepInfo, newest_complete, scan_node
from lightning_distckpt.tiers.needs import needed_writers
from lightning_distckpt.tiers.options import RecoveryPoint

EVERY_RANK = "every_rank"


def gather_holdings(ctx: TierContext, error: Optional[Exception] = None) -> List[StepInfo]:
    """Collective: every node's checked holdings (listed by its lead), the same list on every rank;
    ``error`` (this rank's bad argument, say) is raised on every rank instead."""
    mine: List[StepInfo] = []
    if ctx.is_lead and error is None:
        try:
            mine = scan_node(ctx.root, ctx.node)
        except Exception as e:  # agreed: every rank raises the same
            error = e
    gathered = ctx.comm.agree("local tier: listing the local checkpoints failed", error, mine)
    return [info for part in gathered for info in part]


def recoverable(ctx: TierContext, durable: Any) -> Tuple[Optional[RecoveryPoint], List[StepInfo]]:
    """Collective: the newest recoverable step (see the module docstring; rank 0's ``durable`` list
    decides, a malformed list is an ArgumentError on every rank) and the holdings it was chosen from
    (the same on every rank: the load that follows needs not list and check them again)."""
    checked: List[Tuple[int, str]] = []
    try:
        checked = _check_durable(durable)
    except ArgumentError as e:
        gather_holdings(ctx, e)  # agreed: raised on every rank
        raise
    holdings = gather_holdings(ctx)
    best = newest_complete(holdings)
    local_step = best[0].step if best else None
    error: Optional[Exception] = None
    found: Optional[Tuple[int, str]] = None
    if ctx.rank == 0:
        try:
            found = _newest_durable(checked, local_step)
        except Exception as e:
            error = e
    found = ctx.comm.agree("local tier: checking the durable checkpoints failed", error, found)[0]
    if found is not None:
        return RecoveryPoint(found[0], "durable", found[1]), holdings
    return (RecoveryPoint(local_step, "local") if local_step is not None else None), holdings


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


def _newest_durable(durable: List[Tuple[int, str]], newer_than: Optional[int]) -> Optional[Tuple[int, str]]:
    """The newest committed durable checkpoint with a step above ``newer_than`` (its metadata checked)."""
    for step, location in sorted(durable, key=lambda d: d[0], reverse=True):
        if newer_than is not None and step <= newer_than:
            return None
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


def _ready_for(ctx: TierContext, ready: Optional[ReadyCopy], template: Dict[str, Any], every_rank: bool) -> bool:
    """Collective: whether every rank's load of ``template`` reads only stores its node's ready copy holds."""
    ok = False
    if ready is not None and every_rank and ready.whole:
        ok = True  # no need to plan this rank's reads (as costly as the load's own planning)
    elif ready is not None and every_rank and isinstance(ready.meta, dict):
        need = needed_writers(template, ready.meta, ready.path, ctx.rank)
        ok = need is not None and need <= ready.held
    return all(ctx.comm.agree("local tier: checking this node's copy failed", None, ok))


def load_local(ctx: TierContext, point: RecoveryPoint, sharded_state_dict: Dict[str, Any],
               process_group: Any, load_kwargs: Dict[str, Any], ready: Dict[int, ReadyCopy],
               holdings: Optional[List[StepInfo]] = None) -> Any:
    """Collective: complete this node's copy of ``point`` (unless ``ready`` says an earlier load of it
    did: then it is remembered there), then the ordinary load from it. ``holdings``: those
    :func:`recoverable` just gathered (the same on every rank), else they are gathered again."""
    from lightning_distckpt.serialization import load

    every_rank = load_kwargs.get("loader", EVERY_RANK) == EVERY_RANK
    known = ready.get(point.step)
    if known is not None and _ready_for(ctx, known, sharded_state_dict, every_rank):
        path = known.path
    else:
        path, held, writers = complete_local_copy(ctx, point.step,
                                                  holdings if holdings is not None else gather_holdings(ctx),
                                                  sharded_state_dict if every_rank else None)
        whole = writers <= held
        ready[point.step] = ReadyCopy(path, held, whole, None if whole else _metadata(path))
    return load(sharded_state_dict, path, process_group=process_group, **{"loader": EVERY_RANK, **load_kwargs})


def _metadata(path: str) -> Any:
    """The parsed ``metadata.json`` of a local copy; None when it cannot be read (the load will say why)."""
    try:
        return parse_json(read_inside(os.path.join(path, METADATA_FILE), METADATA_FILE), path)
    except (OSError, CheckpointingError):
        return None
