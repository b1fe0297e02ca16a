"""What a removal leaves at its aside name, and whether ``clean`` may remove it.

A removal (``storage/local_store.py``: ``_remove_dir``) renames a checkpoint to a ``.removed`` aside name
(:func:`.staging.removal_aside`), checks it there, and only then deletes it. Two things may sit at such a name:
what the removal is deleting (ours: a checkpoint, whole or partly deleted), or what it found there that is
not ours and could not put back because the name was taken again (a user's directory). ``clean`` must tell
them apart: the first is a leftover to remove, the second is never ours to delete. So once the check passes,
the removal drops a note (:data:`REMOVAL_NOTE`) into the aside and deletes that note last: an aside is ours
to clean while it is empty, holds the note, or still is a checkpoint directory of ours
(:func:`.layout.is_checkpoint_dir`: a removal stopped before its note). A user's directory left there never
holds the note, as nothing is written into it.
"""

from __future__ import annotations

import os
import shutil
import stat
from typing import Optional

from .layout import is_checkpoint_dir

# In an aside whose contents a removal checked as its own: "being removed, by us" (the last entry deleted)
REMOVAL_NOTE = ".distckpt-removing"


def mark_removing(aside: str) -> None:
    """Note in ``aside`` (checked as ours a moment ago) that its contents are being removed by us. Made
    exclusively and never through a link: a name already there is not our note (an error, nothing removed)."""
    fd = os.open(os.path.join(aside, REMOVAL_NOTE), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    os.close(fd)


def remove_marked(aside: str, first: Optional[str] = None) -> None:
    """Delete ``aside`` (noted by :func:`mark_removing`): ``first`` (the commit marker: an interrupted removal
    then leaves nothing that says committed), then every other entry, the note last, then the directory. Links
    are removed, never followed."""
    names = sorted(os.listdir(aside), key=lambda n: (n != first, n == REMOVAL_NOTE))
    for name in names:
        path = os.path.join(aside, name)
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:
            continue
        if stat.S_ISDIR(mode):
            shutil.rmtree(path)
        else:
            os.unlink(path)  # (as rmtree unlinks)
        if name == first:
            from .commit import _step  # (commit imports staging, which imports this module)

            _step("removal_after_marker")  # test hook: a removal stopped with its marker gone
    os.rmdir(aside)


def ours_to_clean(aside: str) -> bool:
    """``aside`` (a removal's aside name, a directory) holds only what a removal of ours was deleting: it is
    empty, holds the removal's note (a regular file), or is a checkpoint directory of ours. Anything else (a
    user's directory a removal could not put back) is not ``clean``'s to delete."""
    try:
        if not os.listdir(aside) or stat.S_ISREG(os.lstat(os.path.join(aside, REMOVAL_NOTE)).st_mode):
            return True
    except OSError:  # no note (or gone meanwhile): judged by its contents
        pass
    return is_checkpoint_dir(aside)
