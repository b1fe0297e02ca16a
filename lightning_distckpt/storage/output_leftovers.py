"""What a killed export or conversion left in a directory, for ``clean``: the hidden temporary files
and directories an output is written under before its rename (``output_files.temp_name``:
``.NAME.tmp-PID-RANDOM``), and an earlier export moved aside for a new one (``.NAME.old-PID-RANDOM``)
by a file system without an atomic exchange. They are never taken for an output (hidden, never
renamed into place), but nothing else removed them.

A temporary is removed once its writer is gone (no process of its pid on this host) and it has been
unchanged for ``--older-than`` (a writer on another node is seen only by its writes). An earlier
export moved aside is removed only where ``NAME`` exists again (the new export took its place);
where it does not, it is the only copy: kept, with the command that puts it back.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import stat
import time
from dataclasses import dataclass
from typing import List, Optional

from ..progress import Progress, advance
from .staging import pid_alive, size_and_newest_mtime

_TEMP = re.compile(r"\.(?P<name>.+)\.(?P<tag>tmp|old)-(?P<pid>[0-9]{1,10})-[0-9a-f]{16}\Z", re.S)


@dataclass(frozen=True)
class OutputLeftover:
    """One such temporary (a file or a directory) in the directory ``clean`` looks at."""

    path: str
    target: str  # the output it was written for
    tag: str  # "tmp": being written; "old": an earlier output moved aside
    pid: int
    nbytes: int
    idle_s: float
    committed: bool = False  # (what clean's report reads of every leftover)
    stranded: bool = False

    def verdict(self, older_than_s: float) -> str:
        if pid_alive(self.pid) and self.pid != os.getpid():
            return "keep"
        if self.idle_s < older_than_s:
            return "keep"
        if self.tag == "old" and not os.path.lexists(self.target):
            return "keep"
        return "remove"

    def reason(self, verdict: str, older_than_s: float) -> str:
        what = (f"a temporary of an unfinished write of {self.target}" if self.tag == "tmp"
                else f"an earlier {self.target} moved aside for a new one")
        if verdict == "remove":
            return f"{what}; its writer (pid {self.pid}) is gone"
        if pid_alive(self.pid) and self.pid != os.getpid():
            return f"{what}; pid {self.pid} still runs on this host"
        if self.idle_s < older_than_s:
            return f"{what}; changed {self.idle_s:.0f} s ago (< --older-than {older_than_s:g} s)"
        return (f"{what}, and {os.path.basename(self.target)} is missing: the only copy; put it back with "
                f"mv {shlex.quote(self.path)} {shlex.quote(self.target)}")

    def remove(self, progress: Optional[Progress] = None) -> None:
        """Remove it, checked again first: still ours (a file or directory, not a link) and its writer gone."""
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            return
        if pid_alive(self.pid) and self.pid != os.getpid():
            return
        if stat.S_ISDIR(st.st_mode):
            shutil.rmtree(self.path)
        elif stat.S_ISREG(st.st_mode):
            os.unlink(self.path)
        advance(progress, self.nbytes)


def find_output_leftovers(directory: str) -> List[OutputLeftover]:
    """The temporaries named as ours in ``directory`` (not below it; links and special files skipped)."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    now, out = time.time(), []
    for name in sorted(names):
        m = _TEMP.match(name)
        if m is None:
            continue
        found = _found(os.path.join(directory, name), m, now)
        if found is not None:
            out.append(found)
    return out


def _found(path: str, m: "re.Match[str]", now: float) -> Optional[OutputLeftover]:
    try:
        st = os.lstat(path)
        if stat.S_ISREG(st.st_mode):
            size, newest = st.st_size, st.st_mtime
        elif stat.S_ISDIR(st.st_mode):
            size, newest = size_and_newest_mtime(path)
        else:
            return None  # a link or a special file: not something we write
    except OSError:
        return None
    target = os.path.join(os.path.dirname(path), m.group("name"))
    return OutputLeftover(path, target, m.group("tag"), int(m.group("pid")), size, max(0.0, now - newest))
