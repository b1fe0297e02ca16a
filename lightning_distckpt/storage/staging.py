"""Staging directories: where a save writes before its commit, and what saves that never committed
(a killed job, a lost node) leave behind.

A staging directory is a hidden sibling of its target, ``.NAME.distckpt-staging-<id>`` (same file
system, so the commit is an atomic rename). While a save writes, every rank keeps a small owner
note in it (``.writing/rank_NNNNN.json``: host, pid, start time); the commit removes the notes, so
a committed checkpoint never holds them. The notes let :func:`find_leftovers` tell a save that is
still running on this host (an async save waiting to be finalized, say) from one whose process is
gone. File-system queries only; no collectives.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import time
import uuid
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

from .layout import is_committed

logger = logging.getLogger(__name__)

STAGING_TAG = ".distckpt-staging-"
OWNERS_DIR = ".writing"


def new_staging_dir(target: str) -> str:
    """A fresh staging path beside ``target`` (same file system, so the final rename is atomic)."""
    parent, name = os.path.split(os.path.abspath(target))
    return os.path.join(parent, f".{name}{STAGING_TAG}{uuid.uuid4().hex[:12]}")


def is_staging_dir(path: str) -> bool:
    base = os.path.basename(os.path.normpath(path))
    return base.startswith(".") and STAGING_TAG in base


def target_of(staging: str) -> str:
    """The checkpoint path a staging directory was meant to become."""
    parent, base = os.path.split(os.path.normpath(staging))
    return os.path.join(parent, base[1 : base.rindex(STAGING_TAG)])


def discard(staging: Optional[str]) -> None:
    """Remove an uncommitted staging directory (after a failed save)."""
    if staging and is_staging_dir(staging):
        shutil.rmtree(staging, ignore_errors=True)


def write_owner_note(staging: str, rank: int) -> None:
    """Record that this process is writing into ``staging`` (a hint for ``clean``; not fsync'd)."""
    notes = os.path.join(staging, OWNERS_DIR)
    os.makedirs(notes, exist_ok=True)
    note = {"host": socket.gethostname(), "pid": os.getpid(), "rank": rank, "started_unix": time.time()}
    with open(os.path.join(notes, f"rank_{rank:05d}.json"), "w") as f:
        json.dump(note, f)


def remove_owner_notes(staging: str) -> None:
    """Called by the commit, before ``metadata.json`` is written: committed checkpoints hold no notes."""
    shutil.rmtree(os.path.join(staging, OWNERS_DIR), ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def _live_owners(staging: str) -> List[int]:
    """pids of processes on this host that noted they write into ``staging`` and still run."""
    notes = os.path.join(staging, OWNERS_DIR)
    host, pids = socket.gethostname(), []
    try:
        names = os.listdir(notes)
    except OSError:
        return []
    for name in names:
        try:
            with open(os.path.join(notes, name)) as f:
                note = json.load(f)
            if note.get("host") == host and int(note["pid"]) != os.getpid() and _pid_alive(int(note["pid"])):
                pids.append(int(note["pid"]))
        except (OSError, ValueError, KeyError, TypeError):
            continue  # a half-written note: no evidence of a live owner
    return sorted(pids)


def _size_and_newest_mtime(path: str) -> Tuple[int, float]:
    size, newest = 0, os.lstat(path).st_mtime
    for dirpath, _, files in os.walk(path):
        try:
            newest = max(newest, os.lstat(dirpath).st_mtime)
        except OSError:
            continue
        for name in files:
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except OSError:  # removed while we looked
                continue
            size += st.st_size
            newest = max(newest, st.st_mtime)
    return size, newest


@dataclass(frozen=True)
class Leftover:
    """A staging directory found beside checkpoints, and what may be done with it."""

    path: str
    target: str  # the checkpoint it was meant to become
    nbytes: int
    idle_s: float  # seconds since anything in it last changed
    committed: bool  # holds a complete checkpoint (metadata.json and COMMITTED)
    live_owner_pids: Tuple[int, ...]  # processes on this host still writing into it
    link_to: Optional[str] = None  # set when the name is a symbolic link: never followed nor removed

    @property
    def recoverable(self) -> bool:
        """A committed checkpoint whose target is missing or incomplete: the commit's rename was
        interrupted. It is the only copy: rename it into place, never delete it."""
        return self.committed and self.link_to is None and not is_committed(self.target)

    def verdict(self, older_than_s: float) -> str:
        """``"remove"``, or why it is kept: ``"link"``, ``"recover"``, ``"in-progress"`` or ``"recent"``."""
        if self.link_to is not None:
            return "link"
        if self.recoverable:
            return "recover"
        if self.live_owner_pids:
            return "in-progress"
        if self.idle_s < older_than_s:
            return "recent"
        return "remove"


def find_leftovers(parent: str, target_name: Optional[str] = None, exclude: Sequence[str] = ()) -> List[Leftover]:
    """Staging directories in ``parent`` (of ``target_name`` only, when given), oldest first."""
    try:
        names = os.listdir(parent)
    except FileNotFoundError:
        return []
    skip = {os.path.abspath(p) for p in exclude}
    found, now = [], time.time()
    for name in names:
        path = os.path.join(parent, name)
        if not is_staging_dir(name) or os.path.abspath(path) in skip:
            continue
        target = target_of(path)
        if target_name is not None and os.path.basename(target) != target_name:
            continue
        if os.path.islink(path):  # not ours to follow: whatever it points at is left alone
            found.append(Leftover(path, target, 0, 0.0, False, (), link_to=os.readlink(path)))
            continue
        if not os.path.isdir(path):
            continue
        try:
            nbytes, newest = _size_and_newest_mtime(path)
        except OSError:  # vanished: someone else cleaned or committed it
            continue
        found.append(Leftover(path, target, nbytes, max(0.0, now - newest), is_committed(path),
                              tuple(_live_owners(path))))
    return sorted(found, key=lambda lo: -lo.idle_s)


def warn_about_leftovers(target: str, own_staging: str) -> None:
    """Log one WARNING when earlier saves to ``target`` left staging directories behind."""
    parent, name = os.path.split(os.path.abspath(target))
    leftovers = [lo for lo in find_leftovers(parent, name, exclude=[own_staging]) if not lo.live_owner_pids]
    if not leftovers:
        return
    recover = [lo for lo in leftovers if lo.recoverable]
    logger.warning(
        "checkpoint %s: %d staging director%s of earlier saves that never committed (%.3f GB): %s. "
        "%sRemove them with `python -m lightning_distckpt clean %s`.",
        target, len(leftovers), "y" if len(leftovers) == 1 else "ies", sum(lo.nbytes for lo in leftovers) / 1e9,
        ", ".join(os.path.basename(lo.path) for lo in leftovers),
        f"{recover[0].path} holds a committed checkpoint missing at its target: rename it to recover it. "
        if recover else "",
        parent,
    )


def _committed_siblings(parent: str, limit: int = 3) -> List[str]:
    """Names of the newest committed checkpoints in ``parent`` (newest first)."""
    try:
        names = [n for n in os.listdir(parent) if not n.startswith(".")]
    except OSError:
        return []
    found = []
    for n in names:
        path = os.path.join(parent, n)
        if not os.path.islink(path) and os.path.isdir(path) and is_committed(path):
            found.append((os.path.getmtime(path), n))
    return [n for _, n in sorted(found, reverse=True)[:limit]]


def describe_missing(path: str) -> str:
    """Why ``path`` holds no checkpoint, and where a good one is: a dangling link (what
    ``ModelCheckpoint(save_last="link")`` leaves when the linked save never committed), a committed
    copy stranded in a staging directory, the newest committed checkpoints beside it."""
    path = os.path.abspath(path)
    parent, name = os.path.split(path)
    if os.path.islink(path):
        link = os.readlink(path)
        real = os.path.normpath(os.path.join(parent, link))
        what = f"a link to {link}, which does not exist: that save never committed (e.g. the job stopped first)"
        look_in, look_for = os.path.split(real)
    else:
        what, look_in, look_for = "no such directory", parent, name
    hints = []
    try:
        stranded = [lo for lo in find_leftovers(look_in, look_for) if lo.recoverable]
    except OSError:
        stranded = []
    if stranded:
        hints.append(f"a committed copy is stranded at {stranded[0].path}: rename it to {stranded[0].target}")
    siblings = _committed_siblings(parent)
    if siblings:
        hints.append(f"committed checkpoints in {parent}, newest first: {', '.join(siblings)}")
    return "; ".join([what, *hints])
