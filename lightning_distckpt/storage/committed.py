"""Where the committed checkpoints are, for messages about a path that holds none: the newest ones
beside it or inside it, a committed copy stranded in a staging directory, a dangling link."""

from __future__ import annotations

import os
from typing import List

from ..core.shown import shown
from .layout import is_checkpoint_dir, is_committed
from .staging import find_leftovers


def committed_siblings(parent: str, limit: int = 3) -> List[str]:
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


def committed_inside(path: str) -> List[str]:
    """The newest committed checkpoints in the directory ``path`` when it is no checkpoint itself
    (``ModelCheckpoint``'s ``dirpath`` passed for one of its checkpoints); [] otherwise."""
    if not os.path.isdir(path) or is_checkpoint_dir(path):
        return []
    return committed_siblings(path)


def holding_hint(given: str) -> str:
    """``"; it is a directory holding checkpoints (...): pass one of them, e.g. DIR/NAME"`` for a
    directory that is no checkpoint but holds committed ones (``ModelCheckpoint``'s ``dirpath`` given to
    ``load``), "" otherwise: its listing alone does not say which entries are checkpoints."""
    inside = committed_inside(given)
    if not inside:
        return ""
    return (f"; it is a directory holding checkpoints (newest first: {', '.join(map(shown, inside))}): "
            f"pass one of them, e.g. {shown(os.path.join(given, inside[0]), None)}")


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
    if stranded and stranded[0].live_owner_pids:  # recovery leaves a running commit to finish
        hints.append(f"a save on this host (pid {stranded[0].live_owner_pids[0]}) is committing it "
                     f"({stranded[0].path}): try again when it returns")
    elif stranded:
        hints.append(f"a committed copy is stranded at {shown(stranded[0].path, None)}: rename it to "
                     f"{stranded[0].target}")
    siblings = committed_siblings(parent)
    if siblings:
        # names beside the path are anyone's; this message reaches a terminal (a failed load, the CLI)
        hints.append(f"committed checkpoints in {parent}, newest first: {', '.join(map(shown, siblings))}")
    return "; ".join([what, *hints])
