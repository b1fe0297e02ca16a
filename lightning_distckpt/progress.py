"""Progress of long work (``validate``, ``convert``, ``inspect``, ``clean``): counted where the
bytes are read or written, shown by the CLI as a ``tqdm`` bar on a terminal.

The functions that do long work take ``progress``: None (the default: nothing is counted), or any
object with tqdm's ``total`` attribute and ``update(n)`` method (a ``tqdm`` bar; in tests, a
counter). They set ``total`` once they know it (:func:`set_total`) and call ``update`` with the
bytes each step read or wrote (:func:`advance`); nothing is global, and the library itself never
draws anything. :func:`progress_bar` is the CLI's bar: bytes with a decimal unit, rate and ETA, on
stderr, only when stderr is a terminal and ``--quiet`` is not given; log records printed meanwhile
go above it (``tqdm.contrib.logging``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from typing import Any, Dict, Iterator, Optional, Protocol, TextIO


class Progress(Protocol):
    """What the long operations report to: ``tqdm``'s ``total`` and ``update``."""

    total: Optional[float]

    def update(self, n: int = 1) -> Any: ...


def set_total(progress: Optional[Progress], total: int) -> None:
    """Tell ``progress`` (if any) how many units the work has in all."""
    if progress is not None:
        progress.total = total
        refresh = getattr(progress, "refresh", None)
        if refresh is not None:
            refresh()


def add_total(progress: Optional[Progress], more: int) -> None:
    """Grow ``progress``'s total by ``more`` units found on the way (objects, the common state)."""
    if progress is not None:
        set_total(progress, int(progress.total or 0) + more)


def advance(progress: Optional[Progress], n: int) -> None:
    """Count ``n`` units (bytes, keys, ...) done."""
    if progress is not None and n:
        progress.update(n)


def bar_wanted(quiet: bool, stream: Optional[TextIO] = None) -> bool:
    """A bar is drawn on a terminal only (never into a pipe, a file or a CI log), and not with ``--quiet``."""
    stream = sys.stderr if stream is None else stream
    try:
        return not quiet and stream.isatty()
    except (AttributeError, ValueError):  # a closed or replaced stream
        return False


@contextlib.contextmanager
def progress_bar(enabled: bool, desc: str, unit: str = "B", total: Optional[int] = None,
                 delay: float = 0.0) -> Iterator[Optional[Progress]]:
    """A ``tqdm`` bar on stderr (``unit="B"``: bytes scaled to KB/MB/GB, with their rate and ETA),
    or None when not ``enabled``. ``delay``: seconds before it appears (short work shows none; a
    bar that appeared is cleared at the end). Records of the ``lightning_distckpt`` logger go
    above the bar."""
    if not enabled:
        yield None
        return
    from tqdm import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm

    try:  # a terminal that reports no size (a bare pseudo-terminal) gets 80 x 24: tqdm draws nothing in 0 rows
        sized = os.get_terminal_size(sys.stderr.fileno()).columns > 0
    except (OSError, ValueError, AttributeError):
        sized = False
    shape: Dict[str, Any] = {"dynamic_ncols": True} if sized else {"ncols": 80, "nrows": 24}
    with tqdm(total=total, desc=desc, unit=unit, unit_scale=unit == "B", file=sys.stderr, mininterval=0.2,
              delay=delay, leave=not delay, **shape) as bar, \
            logging_redirect_tqdm(loggers=[logging.getLogger("lightning_distckpt")]):
        yield bar


def note(bar: Optional[Progress], text: str) -> None:
    """Print ``text`` on stderr, above ``bar`` when there is one."""
    write = getattr(bar, "write", None)
    if write is not None:
        write(text, file=sys.stderr)
    else:
        print(text, file=sys.stderr)
