"""Files a save wrote, dropped from the page cache once durable (``posix_fadvise(DONTNEED)``).

A buffered write copies each byte into a page-cache page the kernel must first find. Where the
kernel has just freed pages, it reuses them; where it has none at hand, it takes pages it last
handed back to the host (a VM with free page reporting, as the machines we measure on: 0.3-0.6
CPU-s per 200 MB there, against about a third of that with recycled pages,
``benchmarks/bench_async_cpu.py``). A save written in parts, each part's files dropped once
fsync'd, writes each next part into the pages the previous one freed. A checkpoint's bytes are
rarely read back soon, and dropping them also leaves the training's own cached files (its data set)
in the cache. Clean pages only: a file must be fsync'd before it is dropped, or the kernel keeps
its dirty pages anyway.
"""

from __future__ import annotations

import os
import stat
from typing import Iterable


def drop(paths: Iterable[str]) -> int:
    """Drop each of ``paths`` (files a save wrote and made durable) from the page cache; returns how
    many were advised. Best effort: a file that cannot be opened or advised stays cached; anything
    but a regular file is left alone."""
    if not hasattr(os, "posix_fadvise"):
        return 0
    count = 0
    for path in paths:
        try:  # never blocks: O_NONBLOCK (a FIFO put there opens at once), and only regular files advised
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            if stat.S_ISREG(os.fstat(fd).st_mode):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                count += 1
        except OSError:
            pass
        finally:
            os.close(fd)
    return count
