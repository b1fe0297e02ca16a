"""Where a path that is no checkpoint sits: inside one (its ``metadata.json``, its ``data/``
folder, a rank's files), so that a refusal can name the directory to pass instead."""

from __future__ import annotations

import os
from typing import Optional

# data/rank_00000/t/<key>/<i>/<chunk>: no file of a checkpoint lies deeper below its directory
_DEPTH = 6


def enclosing_checkpoint(path: str) -> Optional[str]:
    """The committed checkpoint directory that ``path`` lies in (a local path), or None."""
    from .layout import is_committed  # layout imports what imports this module

    if "://" in path:
        return None
    here = os.path.abspath(path)
    for _ in range(_DEPTH):
        parent = os.path.dirname(here)
        if parent == here:
            return None
        if is_committed(parent):
            return parent
        here = parent
    return None


def inside_hint(path: str) -> str:
    """``"; it lies inside the checkpoint DIR: pass that directory"``, or "" when it does not."""
    found = enclosing_checkpoint(path)
    return f"; it lies inside the checkpoint {found}: pass that directory" if found else ""
