"""Damaged local copies found by a load: which stores, and keeping them out of every later recovery.

Listing a node's holdings checks only what is cheap (metadata and common state against the commit
marker, each store's size, :mod:`.holdings`); the chunk checksums are verified as the load reads them.
When a load of a local copy fails on some ranks (an error agreed over the ranks, so every rank knows
which), :func:`find_damage` reads back, with their checksums, the stores held by the failing ranks'
nodes (each store by one rank of its node), and every rank gets the same list of damaged stores. The
node's lead then drops each damaged store's held-note (the store is no longer counted as held, by this
recovery's next listing nor by a later job's; nothing else is removed) and logs a WARNING naming it.
A damaged store this node had *fetched* from another node (its note says so) may have come damaged from
there: that node's copy is read back with its checksums too, and its note goes only when it fails them, so a
retry never fetches the same damage again, and an intact source (the note may be from an earlier job's
recovery, the damage done since) is never set aside with it.
"""

from __future__ import annotations

import logging
import os
from typing import Dict, FrozenSet, List, NamedTuple, Optional

from lightning_distckpt.core.errors import CheckpointingError, RankFailure
from lightning_distckpt.tiers.context import TierContext
from lightning_distckpt.tiers.node_store import note_path, read_notes

logger = logging.getLogger(__name__)


class Damage(NamedTuple):
    """One damaged store of one node's step directory."""

    node: str
    writer: int
    path: str  # the step directory
    problem: str  # what validation found (names the file or chunk)
    fetched_from: Optional[str]  # the node it was fetched from during this recovery, else None


def verify_stores(path: str, writers: List[int]) -> Dict[int, str]:
    """writer -> its first problem, for each of ``writers`` whose store in the local copy at ``path``
    fails the checks validation makes (every chunk read and its checksum verified)."""
    from lightning_distckpt.validation.checks import validate_checkpoint  # imports the reading layer

    out: Dict[int, str] = {}
    for w in writers:
        try:
            problems = validate_checkpoint(path, writers={w}).problems
        except CheckpointingError as e:
            problems = [str(e)]
        except Exception as e:  # noqa: BLE001 - the check itself failed: no verdict, so not damage
            logger.warning("local tier: checking rank %d's store in %s failed (%s: %s): not counted as damaged",
                           w, path, type(e).__name__, e)
            problems = []
        if problems:
            out[w] = problems[0]
    return out


def _my_share(ctx: TierContext, held: FrozenSet[int]) -> List[int]:
    """The stores this rank verifies: its node's held ones, dealt out over the node's ranks."""
    ranks = ctx.nodes.ranks_on(ctx.node)
    return [w for i, w in enumerate(sorted(held)) if ranks[i % len(ranks)] == ctx.rank]


def find_damage(ctx: TierContext, path: str, held: FrozenSet[int], failures: Dict[int, RankFailure]) -> List[Damage]:
    """Collective: the damaged stores of the nodes whose ranks' load failed (``failures``, the same on
    every rank), the same list on every rank; their notes dropped (see the module docstring)."""
    failing = {ctx.nodes.node_of(r) for r in failures if 0 <= r < len(ctx.nodes.nodes)}
    mine: List[Damage] = []
    error: Optional[Exception] = None
    if ctx.node in failing:
        try:
            notes = read_notes(path)
            for w, problem in sorted(verify_stores(path, _my_share(ctx, held)).items()):
                note = notes.get(w, {})
                source = note.get("from") if note.get("fetched") else None
                mine.append(Damage(ctx.node, w, path, problem, source if isinstance(source, str) else None))
        except Exception as e:  # agreed: every rank raises it
            error = e
    gathered = ctx.comm.agree("local tier: checking the local copies a failed load read failed", error, mine)
    damage = [d for part in gathered for d in part]
    damage += _damaged_sources(ctx, damage)
    error = None
    if ctx.is_lead:
        try:
            _drop_notes(ctx, damage)
        except Exception as e:
            error = e
    ctx.comm.agree("local tier: setting the damaged local copies aside failed", error)
    return damage


def _damaged_sources(ctx: TierContext, damage: List[Damage]) -> List[Damage]:
    """Collective: this node's copies of the stores that another node found damaged and had fetched from
    here, read back with their checksums (dealt over the node's ranks); the damaged ones, on every rank."""
    sent = sorted({(d.writer, os.path.basename(d.path)) for d in damage if d.fetched_from == ctx.node})
    ranks = ctx.nodes.ranks_on(ctx.node)
    mine: List[Damage] = []
    error: Optional[Exception] = None
    try:
        for i, (w, name) in enumerate(sent):
            own = os.path.join(ctx.root, name)
            problem = verify_stores(own, [w]).get(w) if ranks[i % len(ranks)] == ctx.rank and w in read_notes(own) \
                else None
            if problem:
                mine.append(Damage(ctx.node, w, own, f"arrived damaged elsewhere; here too: {problem}", None))
    except Exception as e:  # agreed: every rank raises it
        error = e
    gathered = ctx.comm.agree("local tier: checking the copies damaged stores were fetched from failed", error, mine)
    return [d for part in gathered for d in part]


def _drop_notes(ctx: TierContext, damage: List[Damage]) -> None:
    """This node's lead: the held-notes of its damaged stores removed (those sent from here included,
    once found damaged here too: :func:`_damaged_sources`)."""
    for d in damage:
        if d.node == ctx.node:
            logger.warning("local tier: node %s: the copy of rank %d's store in %s %s and is not used: %s",
                           d.node, d.writer, d.path, what_is_wrong(d.problem), d.problem)
            _remove(note_path(d.path, d.writer))


def what_is_wrong(problem: str) -> str:
    """A store validation refused, in words: damaged, or replaced by another save's (its save token says
    so), or either (a checksum that covers the token fails: which one cannot be told)."""
    if "written by another save" not in problem:
        return "is damaged"
    if "checksum mismatch" in problem:
        return "is damaged or was written by another save"
    return "was written by another save (replaced: copied in from another checkpoint), not damaged"


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass
