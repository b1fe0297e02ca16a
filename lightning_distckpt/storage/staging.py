"""Staging directories: where a save writes before its commit, and what saves that never committed
(a killed job, a lost node) leave behind.

A staging directory is a hidden sibling of its target (same file system, so the commit is an atomic
rename); its name, in one of three forms, is made and read back by :mod:`.staging_names`.

While a save writes, every rank keeps a small owner note in it (``.writing/rank_NNNNN.json``: host,
pid, start time). The notes let :func:`find_leftovers` tell a save that is still running on this
host (an async save waiting to be finalized, say) from one whose process is gone. The commit removes
them only once its marker is durable and before the rename, so a staging directory is never without
both (``clean`` keeps one that holds the marker while it is the only committed copy or newer than
its target) and a committed checkpoint never holds notes. File-system queries only; no collectives.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import math
import os
import shlex
import shutil
import socket
import stat
import threading
import time
from dataclasses import dataclass
from typing import Iterator, List, Optional, Sequence, Set, Tuple

from ..core.errors import CheckpointingError, FormatError, naming_file
from .layout import COMMIT_MARKER, is_committed, is_our_committed_checkpoint, is_our_marker, parse_json
from .paths import MARKER_CAP, holds_nothing, read_inside
from .removal_aside import ours_to_clean
from .remove_tree import remove_tree
from .staging_names import (OWNERS_DIR, REMOVAL_SUFFIX, STAGING_TAG, is_removal_aside,  # noqa: F401 (importable
                            is_staging_dir, names_target, new_staging_dir, removal_aside, target_of)  # from here)

logger = logging.getLogger(__name__)

# Staging directories this process writes into: its own notes name its own pid, which
# _live_owners does not count (a pid reused by a later container), yet an async save in a
# thread of this process is as live as any.
_OWN_STAGING: Set[str] = set()
_OWN_LOCK = threading.Lock()  # saves in several threads (an async save's, a local tier's) note theirs at once
_MAX_NOTE_BYTES = 1 << 16  # a note is ~100 bytes: more is not one of ours


def discard(staging: Optional[str]) -> None:
    """Remove an uncommitted staging directory (after a failed save)."""
    if staging and is_staging_dir(staging):
        with _OWN_LOCK:
            _OWN_STAGING.discard(os.path.abspath(staging))
        remove_tree(staging, f"the staging directory {staging} of a failed save (`clean` removes it once no save "
                    "writes there)")


@contextlib.contextmanager
def parent_lock(parent: str, exclusive: bool) -> Iterator[None]:
    """``flock`` on the directory ``parent`` (shared: a save making its staging directory and owner
    note in it; exclusive: ``clean`` checking a staging directory again and removing it), so that
    ``clean`` never sees a staging directory of a save on this host without its note: it is made and
    its note written (not atomically: an empty note reads as no owner) in one shared hold. Released
    when the process dies. Where the file system has no ``flock`` (or ``parent`` cannot be opened),
    nothing is locked, as before."""
    try:
        fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        except OSError as e:
            logger.debug("%s: no flock (%s); staging directories not locked against clean", parent, e)
        yield
    finally:
        os.close(fd)  # releases the lock


def write_owner_note(staging: str, rank: int, target: Optional[str] = None) -> None:
    """Record that this process is writing into ``staging`` (a hint for ``clean``; not fsync'd), and the
    name of the ``target`` it is to become (what :func:`~.staging_names.target_of` reads back where the
    staging name does not spell it)."""
    with _OWN_LOCK:  # iterated here while another thread's save adds or discards its own
        _OWN_STAGING.difference_update([p for p in _OWN_STAGING if not os.path.lexists(p)])  # committed elsewhere
        _OWN_STAGING.add(os.path.abspath(staging))
    notes = os.path.join(staging, OWNERS_DIR)
    os.makedirs(notes, exist_ok=True)
    note = {"host": socket.gethostname(), "pid": os.getpid(), "rank": rank, "started_unix": time.time(),
            **({"target": os.path.basename(os.path.abspath(target))} if target else {})}
    path = os.path.join(notes, f"rank_{rank:05d}.json")
    with naming_file(path), open(path, "w") as f:
        json.dump(note, f)


def remove_owner_notes(staging: str) -> None:
    """Called by the commit once its marker is durable, before the rename (committed checkpoints
    hold no notes): every rank's note stays until then, so ``clean`` sees the save as running."""
    with _OWN_LOCK:
        _OWN_STAGING.discard(os.path.abspath(staging))
    shutil.rmtree(os.path.join(staging, OWNERS_DIR), ignore_errors=True)


def live_owner_pids(staging: str) -> Tuple[int, ...]:
    """Processes on this host writing into ``staging`` (this one included) that still run."""
    pids = set(_live_owners(staging))
    with _OWN_LOCK:
        own = os.path.abspath(staging) in _OWN_STAGING
    if own:
        pids.add(os.getpid())
    return tuple(sorted(pids))


def commit_time(checkpoint_dir: str) -> Optional[float]:
    """When the checkpoint in ``checkpoint_dir`` was committed: its marker's ``committed_unix``, or
    the marker file's mtime where the marker records none (written once, it moves with the
    directory). None when there is no marker as a regular file of a plausible size, or it is not a
    JSON object."""
    marker = os.path.join(checkpoint_dir, COMMIT_MARKER)
    try:
        st = os.lstat(marker)
        if not stat.S_ISREG(st.st_mode) or st.st_size > MARKER_CAP.limit():
            return None
        data = parse_json(read_inside(marker, "commit marker", max_bytes=MARKER_CAP), marker)
    except (OSError, CheckpointingError):
        return None
    if not isinstance(data, dict):
        return None
    when = data.get("committed_unix")
    if type(when) in (int, float) and math.isfinite(when):
        return float(when)
    return st.st_mtime


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` runs on this host (one of another user counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def _live_owners(staging: str) -> List[int]:
    """pids of processes on this host that noted they write into ``staging`` and still run. A note
    that is not a small regular file (a FIFO, a link, a directory) is no evidence of a live owner:
    it is read without waiting (:func:`~lightning_distckpt.storage.paths.read_inside`), or skipped."""
    notes = os.path.join(staging, OWNERS_DIR)
    host, pids = socket.gethostname(), []
    try:
        names = os.listdir(notes)
    except OSError:
        return []
    for name in names:
        try:
            note = json.loads(read_inside(os.path.join(notes, name), "owner note", max_bytes=_MAX_NOTE_BYTES))
            pid = int(note["pid"])
            if note.get("host") == host and 0 < pid != os.getpid() and pid_alive(pid):  # 0, -1: groups
                pids.append(pid)
        except (OSError, ValueError, KeyError, TypeError, AttributeError, OverflowError, RecursionError,
                FormatError):
            continue  # a half-written note, or not a note: no evidence of a live owner
    return sorted(pids)


def size_and_newest_mtime(path: str) -> Tuple[int, float]:
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
    # the checkpoint it was meant to become; None: a long name recorded only by its hash, whose notes are
    # gone and whose target is missing (staging_names: kept while committed, never renamed by clean)
    target: Optional[str]
    nbytes: int
    idle_s: float  # seconds since anything in it last changed
    committed: bool  # holds a complete checkpoint (metadata.json and COMMITTED)
    live_owner_pids: Tuple[int, ...]  # processes on this host still writing into it
    link_to: Optional[str] = None  # set when the name is a symbolic link: never followed nor removed
    # committed, and its target holds a committed checkpoint at least as new: this copy is not needed
    superseded: bool = False
    # a removal's aside holding what is not ours (removal_aside.ours_to_clean): a user's directory, never removed
    foreign: bool = False

    @property
    def recoverable(self) -> bool:
        """A committed checkpoint whose target is missing or incomplete: the commit's rename was
        interrupted. It is the only copy: rename it into place, never delete it."""
        return self.committed and self.link_to is None and (self.target is None or not is_committed(self.target))

    def verdict(self, older_than_s: float) -> str:
        """``"remove"``, or why it is kept: ``"link"``, ``"not-ours"`` (:attr:`foreign`), ``"recover"``,
        ``"newer"``, ``"in-progress"`` or ``"recent"``. A copy holding the commit marker is never removed
        unless its target holds a committed checkpoint at least as new: it is then the only committed copy
        (``"recover"``), or a commit that has not swapped it in yet, running or killed (``"newer"``: a newer
        save of the target supersedes it)."""
        if self.link_to is not None or self.foreign:  # never removed
            return "not-ours" if self.foreign else "link"
        if self.committed and not self.superseded:
            return "recover" if self.recoverable else "newer"
        if self.live_owner_pids:
            return "in-progress"
        if self.idle_s < older_than_s:
            return "recent"
        return "remove"

    def reason(self, verdict: str, older_than_s: float) -> str:
        """Why ``clean`` keeps or removes this directory, in words (``verdict`` from :meth:`verdict`)."""
        name = "its checkpoint" if self.target is None else os.path.basename(self.target)
        if verdict == "link":
            return f"refused: a symbolic link (to {self.link_to}); links are not followed and not removed"
        if verdict == "not-ours":
            return (f"refused: not a checkpoint of ours but what a removal of {name} found at that name and could "
                    f"not put back (the name was taken again); never removed: move it where it belongs")
        if verdict == "recover" and self.target is None:
            return ("holds a committed checkpoint whose name (too long to spell in a staging name) was not recorded "
                    "and is not beside it: the next save or load of that checkpoint renames it into place")
        if verdict == "recover" and self.stranded:  # not recovered: dry run, or its commit still runs here
            return (f"holds a committed checkpoint and {name} is missing (or an empty placeholder): "
                    + (f"a save on this host (pid {self.live_owner_pids[0]}) is renaming it into place"
                       if self.live_owner_pids else f"mv {shlex.quote(self.path)} {shlex.quote(self.target)}"))
        if verdict == "recover":
            return (f"holds a committed checkpoint and {name} is not one; move {shlex.quote(self.target)} away, "
                    f"then: mv {shlex.quote(self.path)} {shlex.quote(self.target)}")
        if verdict == "newer":
            return (f"holds a committed checkpoint newer than {name}: its commit is under way, or was stopped "
                    f"before its rename (kept until a newer save of it commits)")
        if verdict == "in-progress":
            return "a save is writing into it (pid " + ", ".join(map(str, self.live_owner_pids)) + " on this host)"
        if verdict == "recent":
            return f"changed {self.idle_s:.0f} s ago (< --older-than {older_than_s:.0f} s): a save may still be running"
        if is_removal_aside(self.path):
            return f"left by an interrupted removal of {name}, idle {self.idle_s:.0f} s"
        return "superseded by the committed checkpoint at its target" if self.committed else \
            f"uncommitted, idle {self.idle_s:.0f} s"

    @property
    def stranded(self) -> bool:
        """Nothing (or an async save's empty placeholder) is at the target this committed copy was meant to
        become: it awaits recovery."""
        return self.target is None or holds_nothing(self.target)


def _superseded(path: str, target: Optional[str]) -> bool:
    """``target`` holds a committed checkpoint of ours committed no earlier than the one in ``path`` (a
    user's directory there holding files named ``COMMITTED`` and ``metadata.json`` supersedes nothing)."""
    if target is None:  # its target is missing: nothing there supersedes it
        return False
    mine = commit_time(path)
    if mine is None or os.path.islink(target) or not (is_our_committed_checkpoint(target) and is_our_marker(target)):
        return False
    theirs = commit_time(target)
    return theirs is not None and theirs >= mine


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
        if target_name is not None and not names_target(path, target_name):
            continue
        target = os.path.join(parent, target_name) if target_name is not None else target_of(path)
        if os.path.islink(path):  # not ours to follow: whatever it points at is left alone
            found.append(Leftover(path, target, 0, 0.0, False, (), link_to=os.readlink(path)))
            continue
        if not os.path.isdir(path):
            continue
        # Owners and the marker first: a commit that removes its notes after its marker is durable
        # is then seen with one or the other (or both), never with neither. A removal's aside is uncommitted
        # whatever it holds (never recovered into place nor kept), and removed only if it holds what is ours.
        owners, committed = live_owner_pids(path), is_committed(path) and not is_removal_aside(name)
        foreign = is_removal_aside(name) and not ours_to_clean(path)
        try:
            nbytes, newest = size_and_newest_mtime(path)
        except OSError:  # vanished: someone else cleaned or committed it
            continue
        found.append(Leftover(path, target, nbytes, max(0.0, now - newest), committed, owners,
                              superseded=committed and _superseded(path, target), foreign=foreign))
    return sorted(found, key=lambda lo: -lo.idle_s)


def warn_about_leftovers(target: str, own_staging: str) -> None:
    """Log one WARNING when earlier saves to ``target`` left staging directories behind, and one when
    another process on this host (another job: this process's own saves are not counted) is saving to it."""
    parent, name = os.path.split(os.path.abspath(target))
    found = find_leftovers(parent, name, exclude=[own_staging])
    running = [lo for lo in found if lo.live_owner_pids and os.getpid() not in lo.live_owner_pids]
    if running:
        logger.warning("checkpoint %s: another save to it is running on this host (pid %s, writing %s): whichever "
                       "commits last replaces the other's checkpoint; give each job its own folder", target,
                       ", ".join(map(str, running[0].live_owner_pids)), running[0].path)
    idle = [lo for lo in found if not lo.live_owner_pids]
    # a symbolic link, or a user's directory a removal put aside: not a save's, and clean leaves them alone
    alien = [lo for lo in idle if lo.verdict(math.inf) in ("link", "not-ours")]
    if alien:
        logger.warning("checkpoint %s: %s beside it %s not ours (%s) and left alone, by clean too", target,
                       ", ".join(os.path.basename(lo.path) for lo in alien), "is" if len(alien) == 1 else "are",
                       alien[0].reason(alien[0].verdict(math.inf), math.inf))
    leftovers = [lo for lo in idle if lo not in alien]
    if not leftovers:
        return
    kept = [lo for lo in leftovers if lo.verdict(math.inf) in ("recover", "newer")]
    logger.warning(
        "checkpoint %s: %d staging director%s of earlier saves that never committed or never replaced it "
        "(%.3f GB): %s. "
        "%sRemove them with `python -m lightning_distckpt clean %s`.",
        target, len(leftovers), "y" if len(leftovers) == 1 else "ies", sum(lo.nbytes for lo in leftovers) / 1e9,
        ", ".join(os.path.basename(lo.path) for lo in leftovers),
        f"{kept[0].path} holds a committed checkpoint its commit never renamed into place; clean keeps it "
        f"until a newer save of {name} commits. " if kept else "",
        parent,
    )
