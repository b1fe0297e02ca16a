"""A node root is one job's at a time.

:mod:`.private_root` keeps other users out of a node root; this user's own jobs could still share one: two
experiments started from one config (``local_dir: /dev/shm/ckpt``), or a requeued job's new incarnation
while the old one still runs. Each would prune the other's steps (as newer than its own step: an abandoned
run's, or as beyond ``keep_local``) and, asked what to recover, name the other's newest step, which loads
(its checksums are its own) with another model's values.

So each node's lead holds an exclusive ``flock`` on two lock files of the root while its tier lives
(:func:`claim_root`); a job whose lead cannot take one fails on every rank with an ``ArgumentError`` naming
the root and the process that holds it. The lock goes with the last tier of the process using the root
(closed, superseded or dropped) or with the process, however it ends; a second tier of the same process (a
second Trainer in one script) shares it. The two files:

* ``.ldc-tier-root.lock`` in the root itself: seen by every job that sees the root, whatever temporary
  directory it has (a private ``/tmp`` per job: systemd's ``PrivateTmp``, a container's, SLURM's
  ``TMPDIR``). The root is private (checked first), so no one else can make or hold it.
* ``tier-root-<hash of the root's real path>.lock`` in this user's private folder of the temporary
  directory, ``$TMPDIR/lightning_distckpt-<uid>``: it stays while the root is removed and made again (a
  lost node's directory) under a job that still holds the first one's file.

``clean`` takes them too (:func:`hold_for_clean`), so it never removes what a running job is writing or
about to recover, and a job does not start on a root while ``clean`` works in it. Where
no lock can be had (no ``flock``, the folder not private) nothing is held, as before (logged).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import socket
import stat
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from lightning_distckpt.core.errors import ArgumentError
from lightning_distckpt.tiers.private_root import make_private, unsafe_reason

logger = logging.getLogger(__name__)

ROOT_LOCK_NAME = ".ldc-tier-root.lock"  # the lock file in the root itself
_NOTE_BYTES = 1 << 12  # the holder's note: ~150 bytes
_TRIES = 8  # a lock file removed by its releasing holder between our open and our flock: open it again

Locked = List[Tuple[int, str]]  # (fd holding the flock, the lock file's path)


@dataclass
class _Held:
    locked: Locked
    users: int  # tiers of this process using the root (or 1: clean)


_HELD: Dict[str, _Held] = {}  # by the root's real path
_GUARD = threading.Lock()


class _Busy(Exception):
    """Another process holds a lock file of the root: who (its note)."""


class RootClaim:
    """A tier's use of its node root's lock (:func:`claim_root`); :meth:`release` once it is done with it."""

    def __init__(self, key: Optional[str] = None) -> None:
        self._key = key

    def release(self, remove: bool = True) -> None:
        """Idempotent. The last user of this process removes the lock files and closes them (the flock goes
        with the close); removed first, while held, so that no one locks a file about to vanish. Not
        ``remove``: closed only (a tier collected unclosed, at any moment: a removal then would race
        whatever the program does with the root meanwhile, an ``rmtree`` of it say)."""
        key, self._key = self._key, None
        with _GUARD:
            held = _HELD.get(key) if key is not None else None
            if held is None:
                return
            held.users -= 1
            if held.users == 0:
                del _HELD[key]
                _unlock(held.locked, remove)


def claim_root(path: str) -> RootClaim:
    """Hold the node root ``path`` (private, existing) for this job (see the module docstring)."""
    key = os.path.realpath(path)
    with _GUARD:
        if key in _HELD:
            _HELD[key].users += 1
            return RootClaim(key)
        try:
            locked = _take(path, _lock_files(path, key, create=True), create=True)
        except _Busy as e:
            raise ArgumentError(f"TierOptions.local_dir: the node-local directory {path} is in use by another job "
                                f"({e}): jobs sharing one prune each other's steps and recover the other's as "
                                f"their own; give each job its own local_dir (e.g. /dev/shm/$USER/<job>/ckpt), or "
                                f"stop the other one") from None
        if not locked:
            return RootClaim()
        _HELD[key] = _Held(locked, 1)
    return RootClaim(key)


def hold_for_clean(directory: str, create: bool) -> Tuple[RootClaim, Optional[str]]:
    """``clean``, before it removes anything in ``directory``: ``(claim, None)`` with its lock files taken
    (made where missing if ``create``: a node root; else only those a tier left there), or
    ``(RootClaim(), holder)`` when a job (this process included) holds them; ``holder`` names it."""
    key = os.path.realpath(directory)
    with _GUARD:
        if key in _HELD:
            return RootClaim(), f"pid {os.getpid()} (this process)"
        try:
            locked = _take(directory, _lock_files(directory, key, create), create, by="clean")
        except _Busy as e:
            return RootClaim(), str(e)
        if not locked:
            return RootClaim(), None
        _HELD[key] = _Held(locked, 1)
    return RootClaim(key), None


def _lock_files(path: str, key: str, create: bool) -> List[str]:
    """The lock files of the root ``path`` (real path ``key``): the temporary folder's where its folder is
    usable (made if ``create``), and the root's own."""
    out = []
    folder = os.path.join(tempfile.gettempdir(), f"lightning_distckpt-{os.geteuid()}")
    try:
        if create:
            make_private(folder)
        problem = unsafe_reason(folder) if os.path.isdir(folder) or create else "missing"
    except OSError as e:
        problem = str(e)
    if problem is None:
        out.append(os.path.join(folder, f"tier-root-{hashlib.sha256(os.fsencode(key)).hexdigest()[:32]}.lock"))
    elif create:
        logger.warning("local tier: %s: the lock folder %s is not usable (%s): only the lock file in the root "
                       "keeps other jobs out", path, folder, problem)
    out.append(os.path.join(key, ROOT_LOCK_NAME))
    return out


def _take(path: str, locks: List[str], create: bool, by: Optional[str] = None) -> Locked:
    """Each of ``locks`` flocked (with this process's note) where it can be; :class:`_Busy` (nothing kept
    held) where another process holds one."""
    locked: Locked = []
    try:
        for lock in locks:
            fd = _lock(path, lock, create, by)
            if fd is not None:
                locked.append((fd, lock))
    except BaseException:
        _unlock(locked)
        raise
    return locked


def _unlock(locked: Locked, remove: bool = True) -> None:
    for fd, lock in locked:
        if remove and _is_at(fd, lock):  # not another job's, made after the root was removed and made again
            try:
                os.unlink(lock)
            except OSError:
                pass
        os.close(fd)


def _lock(path: str, lock: str, create: bool, by: Optional[str]) -> Optional[int]:
    """The fd of ``lock``, flocked and holding this process's note; None where it cannot be locked (or, not
    ``create``, is not there: no one holds it); :class:`_Busy` naming the holder where another process has it."""
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK | (os.O_CREAT if create else 0)
    for _ in range(_TRIES):
        try:
            fd = os.open(lock, flags, 0o600)  # never through a link, never waiting on a FIFO
        except FileNotFoundError:
            if create:
                logger.debug("local tier: %s is not locked against other jobs: %s is gone", path, lock)
            return None
        except OSError as e:  # a link or a directory of that name (the root is this user's): not a lock of ours
            logger.warning("local tier: %s is not locked against other jobs: cannot open %s: %s", path, lock, e)
            return None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise OSError(f"{lock} is not a regular file")
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise _Busy(holder) from None
        except OSError as e:  # a file system without flock, a FIFO of that name
            os.close(fd)
            logger.debug("local tier: %s is not locked against other jobs: %s", path, e)
            return None
        if _is_at(fd, lock):  # not a file its last holder removed between our open and our flock
            note = {"pid": os.getpid(), "host": socket.gethostname(), "since_unix": time.time(), "root": path,
                    **({"by": by} if by else {})}
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(note).encode(), 0)
            return fd
        os.close(fd)
    logger.debug("local tier: %s is not locked against other jobs: its lock file kept being replaced", path)
    return None


def _is_at(fd: int, path: str) -> bool:
    try:
        return os.path.samestat(os.fstat(fd), os.lstat(path))
    except OSError:
        return False


def _holder(fd: int) -> str:
    """Who holds the lock, from the note its holder wrote (unreadable or not written yet: "a process")."""
    try:
        note = json.loads(os.pread(fd, _NOTE_BYTES, 0))
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(note["since_unix"])))
        by = f" ({str(note['by'])[:40]})" if note.get("by") else ""
        return f"pid {int(note['pid'])}{by} on host {str(note['host'])[:100]!r}, since {since}"
    except (OSError, ValueError, KeyError, TypeError, OverflowError, AttributeError):
        return "a process holds its lock"
