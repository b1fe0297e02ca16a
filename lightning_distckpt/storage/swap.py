"""Putting a new directory (or link) where another one is, so that the path never names nothing.

The commit (:mod:`.commit`), the DCP export (:mod:`..export.dcp_out`) and ``DistModelCheckpoint``'s
``last.ckpt`` link (:mod:`..lightning.last_link`) all replace something that may be there. Where the
file system has ``renameat2(RENAME_EXCHANGE)`` one call swaps the two (a reader sees the old entry or
the new one); elsewhere (NFS, Lustre) the old one is renamed aside first and the new one in after.
"""

from __future__ import annotations

import ctypes
import errno
import os
from typing import Callable, Optional

_RENAME_EXCHANGE = 2
# For tests, and for file systems whose renameat2(RENAME_EXCHANGE) misbehaves: replace a checkpoint
# with two renames (target aside, staging in), as on NFS and Lustre where the exchange is missing.
NO_EXCHANGE_ENV = "LIGHTNING_DISTCKPT_NO_RENAME_EXCHANGE"


def exchange_paths(a: str, b: str) -> bool:
    """Atomically swap two paths with renameat2(RENAME_EXCHANGE); False where unsupported (or
    turned off by ``LIGHTNING_DISTCKPT_NO_RENAME_EXCHANGE=1``)."""
    if os.environ.get(NO_EXCHANGE_ENV, "") not in ("", "0"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd = -100
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), b)


def swap_into_place(new: str, dest: str, aside: str,
                    check_old: Optional[Callable[[str], None]] = None) -> Optional[str]:
    """Move ``new`` to ``dest``. Returns where the entry that was at ``dest`` is now (``new``'s path after
    an exchange, else ``aside``), for the caller to remove; None when nothing was there.

    ``check_old(path)`` is called on that entry once it is out of the way, so what is checked is what
    is replaced (not what was at ``dest`` some time before); when it raises, everything is put back
    (``new`` at its path) and the error propagates. When ``new`` cannot be renamed in after the old entry
    went aside, the old one goes back unless something else appeared at ``dest`` meanwhile (then it
    stays at ``aside``: never removed here)."""
    if not os.path.lexists(dest):
        os.rename(new, dest)
        return None
    if exchange_paths(new, dest):  # one step: ``dest`` names the old entry or the new one, never nothing
        if check_old is not None:
            try:
                check_old(new)
            except BaseException:
                exchange_paths(new, dest)
                raise
        return new
    os.rename(dest, aside)
    if check_old is not None:
        try:
            check_old(aside)
        except BaseException:
            os.rename(aside, dest)
            raise
    try:
        os.rename(new, dest)
    except OSError:
        if not os.path.lexists(dest):
            os.rename(aside, dest)
        raise
    return aside
