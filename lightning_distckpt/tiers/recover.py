"""Recovery: agree on the newest recoverable step, and complete each node's copy of it before loading.

:func:`recoverable` gathers every node's checked holdings (:mod:`.holdings`) and picks the newest save
whose every rank store some node of the current job holds; rank 0 checks the durable checkpoints newer
than that, newest first, and the newer of the two wins (the local one at equal steps).

:func:`load` makes every node's directory of that save complete: a node without it receives
``metadata.json``, ``common.pt`` and the commit marker, and every node receives the rank stores it
lacks, each from a rank of a node holding it (:func:`fetch_plan`, spread over holders and receivers).
Received items land in temporary directories; the node's lead renames them into place (a new step
directory appears committed and whole, in one rename). Then the ordinary collective
``lightning_distckpt.load`` reads from each rank's own node directory, resharding as any load.
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

from lightning_distckpt.core.errors import ArgumentError, CheckpointingError, IncompleteCheckpointError
from lightning_distckpt.storage.layout import COMMIT_MARKER, COMMON_FILE, METADATA_FILE, rank_dir
from lightning_distckpt.storage.stores import open_store
from lightning_distckpt.tiers.context import TierContext
from lightning_distckpt.tiers.holdings import StepInfo, newest_complete, scan_node
from lightning_distckpt.tiers.local_save import place
from lightning_distckpt.tiers.node_store import TIER_DIR, remove_step
from lightning_distckpt.tiers.nodes import NodeMap
from lightning_distckpt.tiers.options import RecoveryPoint
from lightning_distckpt.tiers.transfer import Incoming, Outgoing, exchange

BASE_LABEL = "base"
BASE_FILES = (METADATA_FILE, COMMON_FILE, COMMIT_MARKER)


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


def recoverable(ctx: TierContext, durable: Any) -> Optional[RecoveryPoint]:
    """Collective: the newest recoverable step (see the module docstring); rank 0's ``durable`` list
    decides (a malformed list is an ArgumentError on every rank)."""
    checked: List[Tuple[int, str]] = []
    try:
        checked = _check_durable(durable)
    except ArgumentError as e:
        gather_holdings(ctx, e)  # agreed: raised on every rank
        raise
    best = newest_complete(gather_holdings(ctx))
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


class Fetch(NamedTuple):
    """One item a node lacks: ``label`` (``"base"`` or ``"rank_XXXXX"``) sent by ``src`` to ``dst``."""

    label: str
    src: int
    dst: int
    writer: Optional[int]  # the store's rank; None for the base files


def fetch_plan(group: List[StepInfo], nodes: NodeMap) -> List[Fetch]:
    """What each node of the current job lacks of one save, and who sends it (the same on every rank):
    stores spread over their holders and over the receiving node's ranks by writer rank."""
    by_node = {i.node: i for i in group}
    holders_dir = [n for n in nodes.names if n in by_node]
    out: List[Fetch] = []
    for k, node in enumerate(nodes.names):
        ranks = nodes.ranks_on(node)
        have = by_node[node].held if node in by_node else frozenset()
        if node not in by_node:
            out.append(Fetch("base", nodes.lead(holders_dir[k % len(holders_dir)]), ranks[0], None))
        for w in sorted(group[0].writers - have):
            holders = [n for n in nodes.names if n in by_node and w in by_node[n].held]
            src_node = holders[w % len(holders)]
            src_ranks = nodes.ranks_on(src_node)
            out.append(Fetch(f"rank_{w:05d}", src_ranks[w % len(src_ranks)], ranks[w % len(ranks)], w))
    return out


def complete_local_copy(ctx: TierContext, point: RecoveryPoint) -> str:
    """Collective: make this node's directory of ``point`` whole (see the module docstring); its path."""
    group = newest_complete(gather_holdings(ctx), step=point.step)
    if group is None:
        raise IncompleteCheckpointError(f"local tier: step {point.step} is no longer recoverable from the local "
                                        "tiers (some rank's store is held by no node); recover from durable storage")
    plan = fetch_plan(group, ctx.nodes)
    step = point.step
    mine = {i.node: i for i in group}
    here = ctx.step_dir(step)
    outgoing, incoming = [], []
    for f in plan:
        if f.src == ctx.rank:
            src_dir = ctx.step_dir(step)  # the plan names senders on nodes holding the directory
            outgoing.append(Outgoing(f.dst, f.label, src_dir, BASE_FILES) if f.writer is None
                            else Outgoing(f.dst, f.label, rank_dir(src_dir, f.writer)))
        if f.dst == ctx.rank:
            incoming.append(Incoming(f.src, f.label, ctx.tmp_dir(step, f.label)))
    exchange(ctx.comm, outgoing, incoming)
    error: Optional[Exception] = None
    if ctx.is_lead:
        try:
            _assemble(ctx, step, [f for f in plan if ctx.nodes.node_of(f.dst) == ctx.node], ctx.node in mine)
        except Exception as e:
            error = e
    ctx.comm.agree(f"local tier: completing the local copies of step {step} failed", error)
    return here


def _assemble(ctx: TierContext, step: int, fetched: List[Fetch], has_dir: bool) -> None:
    """This node's lead: rename what its ranks received into place. A node without the step directory
    gets it whole in one rename (its base files, then its stores, then the directory)."""
    here = ctx.step_dir(step)
    target = here
    if not has_dir:
        target = ctx.tmp_dir(step, BASE_LABEL)
        os.makedirs(os.path.join(target, TIER_DIR), exist_ok=True)
    for f in fetched:
        if f.writer is not None:
            place(ctx.tmp_dir(step, f.label), target, f.writer, copy_from="fetched")
    if not has_dir:
        if os.path.lexists(here):
            remove_step(here)  # another save of this step, or a torn one: ours, superseded
            if os.path.lexists(here):
                raise CheckpointingError(f"local tier: {here} is in the way and is not a local checkpoint of "
                                         "ours; move it away")
        os.rename(target, here)


def load_local(ctx: TierContext, point: RecoveryPoint, sharded_state_dict: Dict[str, Any],
               process_group: Any, load_kwargs: Dict[str, Any]) -> Any:
    """Collective: complete this node's copy of ``point``, then the ordinary load from it."""
    from lightning_distckpt.serialization import load

    path = complete_local_copy(ctx, point)
    return load(sharded_state_dict, path, process_group=process_group, **load_kwargs)

