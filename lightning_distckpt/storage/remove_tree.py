"""Removing a directory tree of ours and saying when it could not be removed.

``shutil.rmtree(ignore_errors=True)`` leaves an unremovable tree (an immutable file, a read-only directory, a busy
mount) behind silently: a failed save's staging directory then looks like a killed save's, a replaced checkpoint
or an old local-tier step keeps its space (on ``/dev/shm``, memory) and nobody is told why the disk fills."""

from __future__ import annotations

import logging
import os
import shutil
import sys
from typing import List

logger = logging.getLogger(__name__)


def remove_tree(path: str, what: str) -> bool:
    """Remove the directory ``path`` (all it can, as ``ignore_errors``); True when it is gone. Otherwise a warning
    names ``what`` (a description that includes the path), each failure with its full path (an error rmtree
    raises names the entry alone) and what is left in it."""
    errors: List[str] = []
    if sys.version_info >= (3, 12):  # onerror is deprecated there
        said = {"onexc": lambda _f, where, e: errors.append(f"{where}: {e}")}
    else:
        said = {"onerror": lambda _f, where, info: errors.append(f"{where}: {info[1]}")}
    shutil.rmtree(path, **said)
    if not os.path.lexists(path):
        return True
    try:
        left = sorted(os.listdir(path))[:8]
    except OSError as e:
        left = [f"(unlistable: {e})"]
    logger.warning("could not remove %s: %s; left in it: %s", what, "; ".join(errors[:3]) or "no error reported", left)
    return False
