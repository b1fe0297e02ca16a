"""``clean DIR``: remove what killed saves left behind (hidden staging directories), keeping anything
that may still be needed: a save still running on this host, a recently changed directory (a save
on another node), and any copy holding the commit marker that its target does not supersede (a
commit under way, or one killed before its rename). A committed checkpoint whose target is missing
(a commit killed between its two renames) is renamed into place, and the previous checkpoint that
commit moved aside removed (:func:`~lightning_distckpt.storage.commit.recover_interrupted_commit`).

``clean s3://bucket/prefix``: remove the versions no commit marker names (:mod:`..storage.s3_versions`),
older than ``--older-than``, in the checkpoint there or in any location under it; never the
committed version, nor anything not provably written by a save of ours."""

from __future__ import annotations

import math
import numbers
import os
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

from ..core.errors import ArgumentError, ArgumentTypeError, CheckpointingError
from ..core.shown import MESSAGE_LIMIT, shown
from ..progress import Progress, set_total
from ..storage.output_leftovers import OutputLeftover, find_output_leftovers
from ..storage.store import LeftoverChanged
from ..storage.stores import open_store


@dataclass(frozen=True)
class CleanAction:
    leftover: Any  # what the store found: storage.staging.Leftover, storage.s3_versions.S3Leftover, ...
    action: str  # "removed", "would remove", "recovered", "would recover", "kept" or "failed"
    reason: str


def _act(lo: Any, remove: bool, reason: str, dry_run: bool, remover: Callable[[], None]) -> CleanAction:
    """Keep ``lo``, report it as removable (``dry_run``), or remove it with ``remover``."""
    if not remove:
        return CleanAction(lo, "kept", reason)
    if dry_run:
        return CleanAction(lo, "would remove", reason)
    try:
        remover()
    except LeftoverChanged as e:  # checked again just before removal: kept, the others still cleaned
        return CleanAction(lo, "kept", str(e))
    except (OSError, CheckpointingError) as e:  # one that cannot go (a busy mount, an immutable file, a
        # denied delete) must not keep the others: each is reported, the exit status says some failed
        return CleanAction(lo, "failed", f"{reason}; removing it failed: {e}")
    return CleanAction(lo, "removed", reason)


def check_older_than(older_than_s: Any) -> float:
    """``older_than_s`` as seconds: a finite number >= 0. ``nan`` compares false with every age and
    ``-1`` or ``-inf`` make every directory old enough: each would remove a running save's staging
    directory on another node, which only its age protects."""
    if isinstance(older_than_s, bool) or not isinstance(older_than_s, numbers.Real):
        raise ArgumentTypeError(f"older_than_s must be a number of seconds, got {type(older_than_s).__name__}")
    value = float(older_than_s)
    if not math.isfinite(value) or value < 0:
        raise ArgumentError(f"older_than_s (--older-than) must be a finite number of seconds >= 0, got {value!r}")
    return value


def clean(path: str, older_than_s: float, dry_run: bool, progress: Optional[Progress] = None) -> List[CleanAction]:
    """Leftovers of killed saves at ``path`` (a directory of checkpoints, or one checkpoint: then
    its own leftovers), as its store finds them (``CheckpointStore.find_leftovers``), removed unless
    kept for a reason or ``dry_run``; commits interrupted before their checkpoint was in place are
    finished first (``CheckpointStore.recover_leftovers``). ``older_than_s`` must be a finite
    number >= 0 (else ArgumentError). ``progress`` counts the bytes removed."""
    older_than_s = check_older_than(older_than_s)
    store = open_store(path, what="directory")
    if not store.file_system:
        return _clean(store, path, older_than_s, dry_run, progress, None)
    from ..tiers.views import RootsInUse

    in_use = RootsInUse()  # a node-local root a running job holds: nothing in it is touched
    try:
        return _clean(store, path, older_than_s, dry_run, progress, in_use)
    finally:
        in_use.release()


def _clean(store: Any, path: str, older_than_s: float, dry_run: bool, progress: Optional[Progress],
           in_use: Any) -> List[CleanAction]:
    held = in_use is not None and any(in_use.holder(d) for d in (store.location, os.path.dirname(store.location)))
    actions = [] if dry_run or held else [CleanAction(*done) for done in store.recover_leftovers()]
    leftovers = list(store.find_leftovers())
    if store.file_system:  # node-local tiers: unfinished transfers, torn steps (tiers/views.py)
        from ..tiers.views import tier_leftovers

        leftovers += tier_leftovers(path)
        leftovers += find_output_leftovers(store.location)  # killed exports' temporaries
    found = [(lo, lo.verdict(older_than_s)) for lo in leftovers]
    holders = {lo.path: in_use.holder(os.path.dirname(os.path.abspath(lo.path))) for lo, _ in found} if in_use else {}
    found = [(lo, "in use" if holders.get(lo.path) else verdict) for lo, verdict in found]
    if not dry_run:
        set_total(progress, sum(lo.nbytes or 0 for lo, verdict in found if verdict == "remove"))
    for lo, verdict in found:
        if verdict == "in use":
            actions.append(CleanAction(lo, "kept", f"the node-local tier {os.path.dirname(lo.path)} is in use by a "
                                                   f"job ({holders[lo.path]}): its saves and transfers may be running"))
            continue
        reason = lo.reason(verdict, older_than_s)
        if verdict == "recover" and lo.stranded:  # not recovered above: dry run, or its commit still runs here
            actions.append(CleanAction(lo, "would recover" if dry_run else "kept", reason))
            continue
        remover = ((lambda lo=lo: lo.remove(progress)) if isinstance(lo, OutputLeftover)
                   else (lambda lo=lo: store.remove_leftover(lo, progress)))
        actions.append(_act(lo, verdict == "remove", reason, dry_run, remover))
    return actions


def as_json(actions: List[CleanAction]) -> List[Dict[str, Any]]:
    return [{"path": a.leftover.path, "target": a.leftover.target, "bytes": a.leftover.nbytes,
             "idle_s": None if a.leftover.idle_s is None else round(a.leftover.idle_s, 1),
             "committed": a.leftover.committed, "action": a.action,
             "reason": a.reason} for a in actions]


def render(actions: List[CleanAction], path: str) -> str:
    if not actions:
        return f"{shown(path, None)}: no leftover staging directories"
    lines = []
    for a in actions:
        size = f"{a.leftover.nbytes / 1e9:.3f} GB" if a.leftover.nbytes is not None else \
            f"{getattr(a.leftover, 'objects', 0)} object(s)"  # object sizes are not listed
        # names under DIR are anyone's: shown, as the reasons naming them
        lines.append(f"{a.action:12s} {shown(a.leftover.path, None)} ({size}): {shown(a.reason, MESSAGE_LIMIT)}")
    gone = [a.leftover for a in actions if a.action not in ("kept", "failed")]
    verb = "would free" if any(a.action == "would remove" for a in actions) else "freed"
    if all(lo.nbytes is not None for lo in gone):
        amount = f"{sum(lo.nbytes or 0 for lo in gone) / 1e9:.3f} GB"
    else:
        amount = f"{sum(getattr(lo, 'objects', 0) for lo in gone)} object(s)"
    failed = sum(a.action == "failed" for a in actions)
    lines.append(f"{verb} {amount}; kept {sum(a.action == 'kept' for a in actions)}"
                 + (f"; {failed} could not be removed (above)" if failed else ""))
    return "\n".join(lines)
