"""A node root is one job's at a time.

:mod:`.private_root` keeps other users out of a node root; this user's own jobs could still share one: two
experiments started from one config (``local_dir: /dev/shm/ckpt``), or a requeued job's new incarnation
while the old one still runs. Each would prune the other's steps (as newer than its own step: an abandoned
run's, or as beyond ``keep_local``) and, asked what to recover, name the other's newest step, which loads
(its checksums are its own) with another model's values.

So each node's lead holds an exclusive ``flock`` on a lock file of the root while its tier lives
(:func:`claim_root`); a job whose lead cannot take it fails on every rank with an ``ArgumentError`` naming
the root and the process that holds it. The lock goes with the last tier of the process using the root
(closed, superseded or dropped) or with the process, however it ends; a second tier of the same process (a
second Trainer in one script) shares it. The lock file is named by the hash of the root's real path (not
its inode: a root removed and made again may get the inode of another, whose holder may live on) and kept
outside the root (whose entries are the tier's), in this user's private folder of the temporary directory,
``$TMPDIR/lightning_distckpt-<uid>``: jobs that see different temporary directories (a private ``/tmp`` per
job) are not told apart. Where no lock can be had (no ``flock``, the folder not private) nothing is held,
as before (logged).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import socket
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Dict, Optional

from lightning_distckpt.core.errors import ArgumentError
from lightning_distckpt.tiers.private_root import make_private, unsafe_reason

logger = logging.getLogger(__name__)

_NOTE_BYTES = 1 << 12  # the holder's note: ~150 bytes
_TRIES = 8  # a lock file removed by its releasing holder between our open and our flock: open it again


@dataclass
class _Held:
    fd: int  # holds the flock
    lock: str  # the lock file's path
    users: int  # tiers of this process using the root


_HELD: Dict[str, _Held] = {}  # by the root's real path
_GUARD = threading.Lock()


class RootClaim:
    """A tier's use of its node root's lock (:func:`claim_root`); :meth:`release` once it is done with it."""

    def __init__(self, key: Optional[str] = None) -> None:
        self._key = key

    def release(self) -> None:
        """Idempotent. The last user of this process removes the lock file and closes it (the flock goes
        with the close); removed first, while held, so that no one locks a file about to vanish."""
        key, self._key = self._key, None
        with _GUARD:
            held = _HELD.get(key) if key is not None else None
            if held is None:
                return
            held.users -= 1
            if held.users == 0:
                del _HELD[key]
                try:
                    os.unlink(held.lock)
                except OSError:
                    pass
                os.close(held.fd)


def claim_root(path: str) -> RootClaim:
    """Hold the node root ``path`` (private, existing) for this job (see the module docstring)."""
    key = os.path.realpath(path)
    with _GUARD:
        if key in _HELD:
            _HELD[key].users += 1
            return RootClaim(key)
        folder = os.path.join(tempfile.gettempdir(), f"lightning_distckpt-{os.geteuid()}")
        try:
            make_private(folder)
            problem = unsafe_reason(folder)
        except OSError as e:
            problem = str(e)
        if problem is not None:
            logger.warning("local tier: %s is not locked against other jobs: the lock folder %s is not usable: %s",
                           path, folder, problem)
            return RootClaim()
        lock = os.path.join(folder, f"tier-root-{hashlib.sha256(os.fsencode(key)).hexdigest()[:32]}.lock")
        fd = _lock(path, lock)
        if fd is None:
            return RootClaim()
        _HELD[key] = _Held(fd, lock, 1)
    return RootClaim(key)


def _lock(path: str, lock: str) -> Optional[int]:
    """The fd of ``lock``, flocked and holding this process's note; None where it cannot be locked."""
    for _ in range(_TRIES):
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise ArgumentError(f"TierOptions.local_dir: the node-local directory {path} is in use by another job "
                                f"({holder}): jobs sharing one prune each other's steps and recover the other's as "
                                f"their own; give each job its own local_dir (e.g. /dev/shm/$USER/<job>/ckpt), or "
                                f"stop the other one") from None
        except OSError as e:  # a file system without flock
            os.close(fd)
            logger.debug("local tier: %s is not locked against other jobs: %s", path, e)
            return None
        if _is_at(fd, lock):  # not a file its last holder removed between our open and our flock
            note = {"pid": os.getpid(), "host": socket.gethostname(), "since_unix": time.time(), "root": path}
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
        return f"pid {int(note['pid'])} on host {str(note['host'])[:100]!r}, since {since}"
    except (OSError, ValueError, KeyError, TypeError, OverflowError):
        return "a process holds its lock"
