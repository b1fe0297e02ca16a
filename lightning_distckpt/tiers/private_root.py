"""A node-local root only this user can write: what the local tier finds there, it restores.

The default root lives in ``/dev/shm``, which every user of the node can write. A root another user
made, or could write or swap, would let them plant a committed step newer than ours (a whole,
self-consistent checkpoint of their making, which recovery would restore: its checksums are theirs
too) and read the weights we write. So, as OpenSSH does for ``~/.ssh``, before the tier uses its root:

- what is missing of the path is created with mode 0700;
- the root (links followed) must be a directory owned by this user that no one else can write;
- every directory above it, on the path as given and on the path links lead to, must be owned by
  this user or by root, and one that others can write must have the sticky bit (``/tmp``,
  ``/dev/shm``), so that no one else can rename what is in it; a link on the way must be owned by this
  user or by root.

"Others can write" is write permission for other users, or for a group that is not this user's
private group (a group of the user's name whose only member is the user, as distributions make).

A root is also one job's at a time, which this user's own jobs could break: :mod:`.root_lock`.
"""

from __future__ import annotations

import os
import stat
from typing import List, Optional

from lightning_distckpt.core.errors import ArgumentError

_ADVICE = "choose a directory of your own, e.g. /dev/shm/$USER/ckpt, or fix its owner and mode (chmod go-w)"


def ensure_private_root(path: str) -> None:
    """Create what is missing of ``path`` (mode 0700) and raise :class:`ArgumentError` unless
    only this user can write it (module docstring). Does nothing where there are no user ids."""
    path = os.path.abspath(path)
    if not hasattr(os, "geteuid"):
        return
    try:
        make_private(path)
        problem = unsafe_reason(path)
    except OSError as e:  # a component that cannot be made, a dangling link, a directory we may not enter
        raise ArgumentError(f"TierOptions.local_dir: the node-local directory {path} cannot be made or "
                            f"examined: {e}") from e
    if problem is not None:
        raise ArgumentError(f"TierOptions.local_dir: the node-local directory {path} is not private: {problem}; "
                                   f"another user could plant checkpoints there that a recovery would restore, "
                                   f"or read this job's; {_ADVICE}")


def make_private(path: str) -> None:
    """``mkdir`` each missing component with mode 0700 (``os.makedirs`` gives the intermediate ones
    the umask's mode). An existing component is left as it is: the checks judge it."""
    missing: List[str] = []
    p = path
    while not os.path.lexists(p):
        missing.append(p)
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    for p in reversed(missing):
        try:
            os.mkdir(p, 0o700)
        except FileExistsError:
            pass  # made meanwhile (another rank of this node): judged below


def _private_group(gid: int) -> bool:
    """Whether ``gid`` is this user's private group (named as the user, no other member)."""
    try:
        import grp
        import pwd

        user = pwd.getpwuid(os.geteuid()).pw_name
        group = grp.getgrgid(gid)
    except (ImportError, KeyError):
        return False
    return group.gr_name == user and set(group.gr_mem) <= {user} and gid == os.getegid()


def _writable_by_others(st: os.stat_result) -> bool:
    if st.st_mode & stat.S_IWOTH:
        return True
    return bool(st.st_mode & stat.S_IWGRP) and not _private_group(st.st_gid)


def _owner(st: os.stat_result) -> str:
    try:
        import pwd

        return f"user {pwd.getpwuid(st.st_uid).pw_name} (uid {st.st_uid})"
    except (ImportError, KeyError):
        return f"uid {st.st_uid}"


def _above(path: str) -> List[str]:
    """The directories above ``path``, nearest first."""
    out = []
    parent = os.path.dirname(path)
    while parent != path:
        out.append(parent)
        path, parent = parent, os.path.dirname(parent)
    return out


def _ancestor_problem(p: str, st: os.stat_result) -> Optional[str]:
    me = os.geteuid()
    if stat.S_ISLNK(st.st_mode):
        return None if st.st_uid in (0, me) else f"the link {p} on its path is owned by {_owner(st)}"
    if st.st_uid not in (0, me):
        return f"{p} above it is owned by {_owner(st)}, who can rename what is in it"
    if _writable_by_others(st) and not st.st_mode & stat.S_ISVTX:
        return f"{p} above it can be written by others (mode {stat.S_IMODE(st.st_mode):o}) and has no sticky bit"
    return None


def unsafe_reason(path: str) -> Optional[str]:
    """Why ``path`` (absolute, existing) is not private to this user, or None when it is."""
    for p in _above(path) + [path]:  # the path as given: links on the way included
        st = os.lstat(p)
        if p == path and not stat.S_ISLNK(st.st_mode):
            continue  # judged as the resolved root below
        problem = _ancestor_problem(p, st)
        if problem is not None:
            return problem
    real = os.path.realpath(path)
    for p in _above(real):  # where the links lead
        problem = _ancestor_problem(p, os.stat(p))
        if problem is not None:
            return problem
    st = os.stat(real)
    where = "" if real == path else f" (the link leads to {real})"
    if not stat.S_ISDIR(st.st_mode):
        return f"it is not a directory{where}"
    if st.st_uid != os.geteuid():
        return f"it is owned by {_owner(st)}, not by this user (uid {os.geteuid()}){where}"
    if _writable_by_others(st):
        return f"others can write it (mode {stat.S_IMODE(st.st_mode):o}){where}"
    return None
