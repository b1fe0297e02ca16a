"""``clean DIR``: remove what killed saves left behind (hidden staging directories), keeping anything
that may still be needed: a save still running on this host, a recently changed directory (a save
on another node), and a committed checkpoint whose rename into place was interrupted.

``clean s3://bucket/prefix``: remove the versions no commit marker names (:mod:`..storage.s3_versions`),
older than ``--older-than``, in the checkpoint there or in any location under it; never the
committed version, nor anything not provably written by a save of ours."""

from __future__ import annotations

import os
import shlex
import shutil
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Union

from ..storage.layout import is_checkpoint_dir
from ..storage.paths import local_path
from ..storage.s3_url import is_s3_url
from ..storage.s3_versions import S3Leftover, find_s3_leftovers, remove_version
from ..storage.staging import Leftover, find_leftovers


@dataclass(frozen=True)
class CleanAction:
    leftover: Union[Leftover, S3Leftover]
    action: str  # "removed", "would remove", or "kept"
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


def clean(path: str, older_than_s: float, dry_run: bool) -> List[CleanAction]:
    """Leftover staging directories in ``path`` (a directory of checkpoints, or one checkpoint: then
    its own leftovers, found beside it), removed unless kept for a reason or ``dry_run``. An
    ``s3://`` location: its uncommitted versions (see :func:`clean_s3`)."""
    if is_s3_url(path):
        return clean_s3(path, older_than_s, dry_run)
    path = os.path.abspath(local_path(path, "directory"))
    name: Optional[str] = None
    if is_checkpoint_dir(path):
        path, name = os.path.split(path)
    actions = []
    for lo in find_leftovers(path, name):
        verdict = lo.verdict(older_than_s)
        if verdict == "link":
            reason = f"refused: a symbolic link (to {lo.link_to}); links are not followed and not removed"
        elif verdict == "recover":
            reason = (f"holds a committed checkpoint and {os.path.basename(lo.target)} is missing or incomplete; "
                      f"recover it with: mv {shlex.quote(lo.path)} {shlex.quote(lo.target)}")
        elif verdict == "in-progress":
            reason = "a save is writing into it (pid " + ", ".join(map(str, lo.live_owner_pids)) + " on this host)"
        elif verdict == "recent":
            reason = f"changed {lo.idle_s:.0f} s ago (< --older-than {older_than_s:.0f} s): a save may still be running"
        else:
            reason = f"uncommitted, idle {lo.idle_s:.0f} s"
        actions.append(_act(lo, verdict == "remove", reason, dry_run, lambda lo=lo: shutil.rmtree(lo.path)))
    return actions


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
