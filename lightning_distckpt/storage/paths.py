"""Which paths a checkpoint may be read from and written to.

* A path with a URL scheme (``gs://``, ``http://``, ``file://``, ...) is refused: no store for it
  exists yet, and treated as a local path it would be written to ``./gs:/bucket/...`` while the
  caller believes it is in the bucket. ``s3://`` locations are taken where
  :func:`checkpoint_location` is used (save and load; see :mod:`.s3`).
* Nothing under a checkpoint directory is followed through a symbolic link: its files are opened
  with ``O_NOFOLLOW`` and its data tree is walked (links not followed) before tensorstore reads it.
  A link elsewhere would make a load read another checkpoint's (or any file's) bytes as ours. The
  checkpoint directory itself may be reached through links (a symlinked parent, the ``last.ckpt``
  link of Lightning's ``save_last="link"``): readers resolve it once, to its real path.

File-system queries only; no collectives. The checks are made before reading and do not guard
against a link swapped in while a load runs (whoever can do that can also rewrite the data).
"""

from __future__ import annotations

import os
import re
import stat
from typing import NamedTuple, Union

from ..core.errors import ArgumentError, ArgumentTypeError, FormatError
from .s3_url import is_s3_url, parse_s3_url

PathLike = Union[str, "os.PathLike[str]"]

_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*://")


def _path_text(path: PathLike, what: str) -> str:
    """``path`` as a str: a str, an ``os.PathLike`` or bytes (decoded with ``os.fsdecode``, as the
    OS does); anything else is an ArgumentTypeError, an empty path, one with a NUL character or one
    that is not UTF-8 (which tensorstore cannot open) an ArgumentError, each naming ``what``."""
    try:
        text = os.fspath(path)
    except TypeError:
        raise ArgumentTypeError(f"{what} must be a path (a str or os.PathLike[str]; bytes are decoded), "
                                f"got {type(path).__name__}") from None
    if isinstance(text, bytes):
        text = os.fsdecode(text)
    if not text:
        raise ArgumentError(f"{what}: the path is empty (give a directory or file name)")
    if "\0" in text:
        raise ArgumentError(f"{what} {text!r}: a path cannot hold a NUL character")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # bytes that os.fsdecode kept as surrogates: tensorstore takes UTF-8 only
        raise ArgumentError(f"{what} {text!r}: the path is not valid UTF-8; rename it") from None
    return text


def local_path(path: PathLike, what: str = "checkpoint") -> str:
    """``path`` as a string (see :func:`_path_text`: the one check of every path argument), refused
    with ArgumentError when it is a URL rather than a local path."""
    text = _path_text(path, what)
    if _SCHEME.match(text):
        raise ArgumentError(
            f"{what} {text}: URLs are not supported (no object-store backend yet); give a local or "
            f"shared file-system path (it would otherwise be written to a local directory named "
            f"{text.split('://', 1)[0]}:)"
        )
    return text


def checkpoint_location(path: PathLike, what: str = "checkpoint") -> str:
    """Where a checkpoint is: an ``s3://`` URL normalized, else the local path made absolute (other
    URLs refused, see :func:`local_path`; ``what`` names the argument in errors). Decided by the
    path alone, so every rank decides alike (credentials, which may differ by rank, are checked
    where failures are agreed)."""
    text = _path_text(path, what)
    if is_s3_url(text):
        return parse_s3_url(text).url
    return os.path.abspath(local_path(text, what))


def refuse_link(path: str, what: str) -> os.stat_result:
    """``lstat`` of ``path``; FormatError when it is a symbolic link (OSError when missing)."""
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise FormatError(
            f"{what} {path} is a symbolic link (to {os.readlink(path)}); refused: nothing inside a checkpoint "
            f"is followed through a link"
        )
    return st


def read_inside(path: str, what: str) -> bytes:
    """The bytes of the regular file ``path`` inside a checkpoint, never through a link.
    A link is a FormatError; a missing or unreadable file raises OSError (callers name it)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        if os.path.islink(path):
            refuse_link(path, what)
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise FormatError(f"{what} {path} is not a regular file")
        chunks = []
        while True:
            chunk = os.read(fd, 1 << 24)
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)
    finally:
        os.close(fd)


class TreeStats(NamedTuple):
    """What a walk of a directory tree found: its regular files and their bytes."""

    files: int
    nbytes: int


def scan_tree(root: str, what: str) -> TreeStats:
    """Count the regular files under the directory ``root`` and their bytes, refusing ``root`` or
    anything in it that is a symbolic link (FormatError naming it). OSError when ``root`` is
    missing or unreadable."""
    st = refuse_link(root, what)
    if not stat.S_ISDIR(st.st_mode):
        raise FormatError(f"{what} {root} is not a directory")
    files = nbytes = 0
    stack = [root]
    while stack:
        with os.scandir(stack.pop()) as entries:
            for entry in entries:
                if entry.is_symlink():
                    refuse_link(entry.path, f"{what}: file")
                if entry.is_dir(follow_symlinks=False):
                    stack.append(entry.path)
                elif entry.is_file(follow_symlinks=False):
                    files += 1
                    nbytes += entry.stat(follow_symlinks=False).st_size
    return TreeStats(files, nbytes)
