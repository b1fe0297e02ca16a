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
import shlex
import shutil
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Union

from ..core.errors import ArgumentError, ArgumentTypeError
from ..progress import Progress, advance, set_total
from ..storage.commit import recover_interrupted_commit
from ..storage.layout import is_checkpoint_dir
from ..storage.paths import local_path
from ..storage.s3_url import is_s3_url
from ..storage.s3_versions import S3Leftover, find_s3_leftovers, remove_version
from ..storage.staging import Leftover, find_leftovers


@dataclass(frozen=True)
class CleanAction:
    leftover: Union[Leftover, S3Leftover]
    action: str  # "removed", "would remove", "recovered", "would recover" or "kept"
    reason: str


def _act(lo: Union[Leftover, S3Leftover], remove: bool, reason: str, dry_run: bool,
         remover: Callable[[], None]) -> CleanAction:
    """Keep ``lo``, report it as removable (``dry_run``), or remove it with ``remover``."""
    if not remove:
        return CleanAction(lo, "kept", reason)
    if dry_run:
        return CleanAction(lo, "would remove", reason)
    remover()
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
    """Leftover staging directories in ``path`` (a directory of checkpoints, or one checkpoint: then
    its own leftovers, found beside it), removed unless kept for a reason or ``dry_run``; committed
    copies stranded by a commit killed between its renames are renamed into place first. An
    ``s3://`` location: its uncommitted versions (see :func:`clean_s3`). ``older_than_s`` must be a
    finite number >= 0 (else ArgumentError). ``progress`` counts the bytes removed."""
    older_than_s = check_older_than(older_than_s)
    if is_s3_url(path):
        return clean_s3(path, older_than_s, dry_run)
    path = os.path.abspath(local_path(path, "directory"))
    name: Optional[str] = None
    if is_checkpoint_dir(path):  # one checkpoint (by our own markers): its leftovers are beside it
        path, name = os.path.split(path)
    actions = [] if dry_run else _recover(path, name)
    found = [(lo, lo.verdict(older_than_s)) for lo in find_leftovers(path, name)]
    if not dry_run:
        set_total(progress, sum(lo.nbytes or 0 for lo, verdict in found if verdict == "remove"))
    for lo, verdict in found:
        if verdict == "link":
            reason = f"refused: a symbolic link (to {lo.link_to}); links are not followed and not removed"
        elif verdict == "recover":
            if not os.path.lexists(lo.target):  # not recovered above: dry run, or its commit still runs here
                reason = (f"holds a committed checkpoint and {os.path.basename(lo.target)} is missing: "
                          + (f"a save on this host (pid {lo.live_owner_pids[0]}) is renaming it into place"
                             if lo.live_owner_pids else f"mv {shlex.quote(lo.path)} {shlex.quote(lo.target)}"))
                actions.append(CleanAction(lo, "would recover" if dry_run else "kept", reason))
                continue
            reason = (f"holds a committed checkpoint and {os.path.basename(lo.target)} is not one; move "
                      f"{shlex.quote(lo.target)} away, then: mv {shlex.quote(lo.path)} {shlex.quote(lo.target)}")
        elif verdict == "newer":
            reason = (f"holds a committed checkpoint newer than {os.path.basename(lo.target)}: its commit is under "
                      f"way, or was stopped before its rename (kept until a newer save of it commits)")
        elif verdict == "in-progress":
            reason = "a save is writing into it (pid " + ", ".join(map(str, lo.live_owner_pids)) + " on this host)"
        elif verdict == "recent":
            reason = f"changed {lo.idle_s:.0f} s ago (< --older-than {older_than_s:.0f} s): a save may still be running"
        else:
            reason = "superseded by the committed checkpoint at its target" if lo.committed else \
                f"uncommitted, idle {lo.idle_s:.0f} s"
        actions.append(_act(lo, verdict == "remove", reason, dry_run,
                            lambda lo=lo: _rmtree(lo.path, lo.nbytes, progress)))
    return actions


def _recover(parent: str, name: Optional[str]) -> List[CleanAction]:
    """Finish the commits in ``parent`` (of ``name`` only, when given) killed between their two
    renames: each missing checkpoint's newest committed copy renamed into place."""
    actions = []
    stranded = [lo for lo in find_leftovers(parent, name)
                if lo.verdict(math.inf) == "recover" and not os.path.lexists(lo.target)]
    by_path = {lo.path: lo for lo in stranded}
    for target in sorted({lo.target for lo in stranded}):
        done = recover_interrupted_commit(target)
        if done is None:
            continue
        if done.placed in by_path:
            actions.append(CleanAction(by_path[done.placed], "recovered",
                                       f"its commit was interrupted before its rename into place: renamed to {target}"))
        actions += [CleanAction(by_path[p], "removed", f"the previous checkpoint that commit had moved aside; "
                                f"superseded by {os.path.basename(target)}") for p in done.removed if p in by_path]
    return actions


def _rmtree(path: str, nbytes: Optional[int] = None, progress: Optional[Progress] = None) -> None:
    """Remove ``path`` (``nbytes`` counted on ``progress``); gone already (its commit renamed it into
    place, or another clean) is fine."""
    try:
        shutil.rmtree(path)
    except FileNotFoundError:
        pass
    advance(progress, nbytes or 0)


def clean_s3(url: str, older_than_s: float, dry_run: bool) -> List[CleanAction]:
    """Uncommitted versions under ``url`` removed unless kept for a reason or ``dry_run``."""
    actions = []
    for lo in find_s3_leftovers(url):
        verdict = lo.verdict(older_than_s)
        if verdict == "foreign":
            reason = f"refused: not provably ours ({lo.foreign})"
        elif verdict == "unknown-age":
            reason = "its version name carries no start time; a save may still be running (--older-than 0 removes it)"
        elif verdict == "recent":
            reason = f"started {lo.idle_s:.0f} s ago (< --older-than {older_than_s:.0f} s): a save may still be running"
        else:
            age = "" if lo.idle_s is None else f", started {lo.idle_s:.0f} s ago"
            reason = f"uncommitted ({lo.objects} object(s){age})"
        actions.append(_act(lo, verdict == "remove", reason, dry_run, lambda lo=lo: remove_version(lo)))
    return actions


def as_json(actions: List[CleanAction]) -> List[Dict[str, Any]]:
    return [{"path": a.leftover.path, "target": a.leftover.target, "bytes": a.leftover.nbytes,
             "idle_s": None if a.leftover.idle_s is None else round(a.leftover.idle_s, 1),
             "committed": a.leftover.committed, "action": a.action,
             "reason": a.reason} for a in actions]


def render(actions: List[CleanAction], path: str) -> str:
    if not actions:
        return f"{path}: no leftover staging directories"
    lines = []
    for a in actions:
        size = f"{a.leftover.nbytes / 1e9:.3f} GB" if a.leftover.nbytes is not None else \
            f"{getattr(a.leftover, 'objects', 0)} object(s)"  # object sizes are not listed
        lines.append(f"{a.action:12s} {a.leftover.path} ({size}): {a.reason}")
    gone = [a.leftover for a in actions if a.action != "kept"]
    verb = "would free" if any(a.action == "would remove" for a in actions) else "freed"
    if all(lo.nbytes is not None for lo in gone):
        amount = f"{sum(lo.nbytes or 0 for lo in gone) / 1e9:.3f} GB"
    else:
        amount = f"{sum(getattr(lo, 'objects', 0) for lo in gone)} object(s)"
    lines.append(f"{verb} {amount}; kept {sum(a.action == 'kept' for a in actions)}")
    return "\n".join(lines)
