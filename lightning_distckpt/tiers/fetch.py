"""Completing a node's copy of one save before a local load: what each node lacks, who sends it, and
putting it in place.

A node without the step directory first receives ``metadata.json``, ``common.pt`` and the commit marker
(the *base*). Then every rank tells which rank stores its load reads (:mod:`.needs`; all of them when it
cannot tell, or when the load uses an exchange loader), and each node receives the stores its ranks need
and it lacks, each from a rank of a node holding it, spread over holders and over the node's ranks
(:func:`store_plan`). Received items land in temporary directories; the node's lead renames them into
place, a new step directory appearing committed and whole in one rename.
"""

from __future__ import annotations

import os
from typing import Any, Dict, FrozenSet, List, NamedTuple, Optional, Tuple

from lightning_distckpt.core.errors import CheckpointingError, IncompleteCheckpointError
from lightning_distckpt.storage.layout import COMMIT_MARKER, COMMON_FILE, METADATA_FILE, parse_json, rank_dir
from lightning_distckpt.storage.paths import METADATA_CAP, read_inside
from lightning_distckpt.tiers.context import TierContext
from lightning_distckpt.tiers.holdings import StepInfo, newest_complete
from lightning_distckpt.tiers.local_save import place
from lightning_distckpt.tiers.needs import needed_writers
from lightning_distckpt.tiers.node_store import TIER_DIR, remove_step
from lightning_distckpt.tiers.nodes import NodeMap
from lightning_distckpt.tiers.transfer import Incoming, Outgoing, exchange

BASE_LABEL = "base"
BASE_FILES = (METADATA_FILE, COMMON_FILE, COMMIT_MARKER)


class Fetch(NamedTuple):
    """One item a node lacks: ``label`` (``"base"`` or ``"rank_XXXXX"``) sent by ``src`` to ``dst``."""

    label: str
    src: int
    dst: int
    writer: Optional[int]  # the store's rank; None for the base files


def base_plan(group: List[StepInfo], nodes: NodeMap) -> List[Fetch]:
    """The base files to each node of the current job without the step directory, from the lead of a
    node with it (spread over them)."""
    have = [n for n in nodes.names if n in {i.node for i in group}]
    return [Fetch(BASE_LABEL, nodes.lead(have[k % len(have)]), nodes.lead(node), None)
            for k, node in enumerate(nodes.names) if node not in have]


def store_plan(group: List[StepInfo], nodes: NodeMap, needs: Dict[str, FrozenSet[int]]) -> List[Fetch]:
    """The stores each node needs (``needs[node]``) and lacks, and who sends each (the same on every rank)."""
    by_node = {i.node: i for i in group}
    out: List[Fetch] = []
    for node in nodes.names:
        ranks = nodes.ranks_on(node)
        have = by_node[node].held if node in by_node else frozenset()
        for w in sorted((needs[node] & group[0].writers) - have):
            holders = [n for n in nodes.names if n in by_node and w in by_node[n].held]
            src_ranks = nodes.ranks_on(holders[w % len(holders)])
            out.append(Fetch(f"rank_{w:05d}", src_ranks[w % len(src_ranks)], ranks[w % len(ranks)], w))
    return out


def _transfer(ctx: TierContext, step: int, plan: List[Fetch]) -> None:
    """Collective: move the items of ``plan`` into the receivers' temporary directories (an empty plan,
    the same on every rank, costs no collective)."""
    if not plan:
        return
    outgoing, incoming = [], []
    here = ctx.step_dir(step)  # senders are on nodes holding the directory
    for f in plan:
        if f.src == ctx.rank:
            outgoing.append(Outgoing(f.dst, f.label, here, BASE_FILES) if f.writer is None
                            else Outgoing(f.dst, f.label, rank_dir(here, f.writer)))
        if f.dst == ctx.rank:
            incoming.append(Incoming(f.src, f.label, ctx.tmp_dir(step, f.label)))
    exchange(ctx.comm, outgoing, incoming)


def _needs(ctx: TierContext, step: int, has_dir: bool, template: Optional[Dict[str, Any]],
           writers: FrozenSet[int]) -> Dict[str, FrozenSet[int]]:
    """Collective: node -> the stores its ranks' loads read (every writer where a rank cannot tell)."""
    mine: Optional[FrozenSet[int]] = None
    if template is not None:
        where = ctx.step_dir(step) if has_dir else ctx.tmp_dir(step, BASE_LABEL)
        try:
            meta = parse_json(read_inside(os.path.join(where, METADATA_FILE), METADATA_FILE, max_bytes=METADATA_CAP),
                              where)
            mine = needed_writers(template, meta, where, ctx.rank) if isinstance(meta, dict) else None
        except (OSError, CheckpointingError):
            mine = None
    gathered = ctx.comm.agree("local tier: planning what to fetch failed", None, mine)
    out: Dict[str, FrozenSet[int]] = {}
    for rank, need in enumerate(gathered):
        node = ctx.nodes.node_of(rank)
        out[node] = out.get(node, frozenset()) | (writers if need is None else need)
    return out


def complete_local_copy(ctx: TierContext, step: int, holdings: List[StepInfo],
                        template: Optional[Dict[str, Any]]) -> Tuple[str, FrozenSet[int], FrozenSet[int]]:
    """Collective: make this node's directory of ``step`` hold what its ranks' load of ``template`` reads
    (everything when ``template`` is None); its path, the writers whose stores it now holds (checked:
    those of the holdings, listed and checked by :func:`.holdings.scan_node`, and those just received)
    and the checkpoint's writers."""
    group = newest_complete(holdings, step=step)
    if group is None:
        raise IncompleteCheckpointError(f"local tier: step {step} is no longer recoverable from the local "
                                        "tiers (some rank's store is held by no node); recover from durable storage")
    has_dir = ctx.node in {i.node for i in group}
    _transfer(ctx, step, base_plan(group, ctx.nodes))
    plan = store_plan(group, ctx.nodes, _needs(ctx, step, has_dir, template, group[0].writers))
    _transfer(ctx, step, plan)
    error: Optional[Exception] = None
    if ctx.is_lead:
        try:
            _assemble(ctx, step, [f for f in plan if ctx.nodes.node_of(f.dst) == ctx.node], has_dir)
        except Exception as e:
            error = e
    ctx.comm.agree(f"local tier: completing the local copies of step {step} failed", error)
    mine = next((i.held for i in group if i.node == ctx.node), frozenset())
    fetched = frozenset(f.writer for f in plan if f.writer is not None and ctx.nodes.node_of(f.dst) == ctx.node)
    return ctx.step_dir(step), mine | fetched, group[0].writers


def _assemble(ctx: TierContext, step: int, fetched: List[Fetch], has_dir: bool) -> None:
    """This node's lead: rename what its ranks received into place. A node without the step directory
    gets it whole in one rename (its base files, then its stores, then the directory)."""
    here = ctx.step_dir(step)
    target = here if has_dir else ctx.tmp_dir(step, BASE_LABEL)
    os.makedirs(os.path.join(target, TIER_DIR), exist_ok=True)
    for f in fetched:
        place(ctx.tmp_dir(step, f.label), target, f.writer, copy_from=ctx.nodes.node_of(f.src), fetched=True)
    if not has_dir:
        if os.path.lexists(here):
            remove_step(here)  # another save of this step, or a torn one: ours, superseded
            if os.path.lexists(here):
                raise CheckpointingError(f"local tier: {here} is in the way and is not a local checkpoint of "
                                         "ours; move it away")
        os.rename(target, here)

