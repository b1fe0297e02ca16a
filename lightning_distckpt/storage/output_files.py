"""Output files that replace nothing that is not ours.

:func:`write_file_atomic` is the one way the exports write a file (a ``torch.save`` export, a
safetensors shard, an index, a ``config.json``): a temporary file beside the output, created here
with ``O_CREAT | O_EXCL | O_NOFOLLOW`` under a name no one can guess ahead (so a link or file
planted at it is never written through or replaced), written, fsync'd, then renamed over the
output. The rename replaces whatever the output name holds, so callers check first what is there:
:func:`check_torch_file_target` for a ``torch.save`` output, :mod:`lightning_distckpt.export.hf_owned`
for a Hugging Face directory.
"""

from __future__ import annotations

import os
import secrets
import stat
import zipfile
from typing import Any, BinaryIO, Callable, List, Optional

from ..core.errors import ArgumentError

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


def temp_name(path: str, tag: str = "tmp") -> str:
    """A fresh name beside ``path``: hidden, naming ``path``, ``tag`` and this process, and random
    (64 bits), so no one can put anything at it ahead of us."""
    return os.path.join(os.path.dirname(path),
                        f".{os.path.basename(path)}.{tag}-{os.getpid()}-{secrets.token_hex(8)}")


def open_new(tmp: str) -> BinaryIO:
    """The file ``tmp`` (made by :func:`write_file_atomic`) open for writing from its start; a link
    put in its place meanwhile is an OSError, never followed."""
    fd = os.open(tmp, os.O_WRONLY | os.O_TRUNC | _NOFOLLOW)
    return os.fdopen(fd, "wb")


def write_file_atomic(path: str, write: Callable[[str], Any], check: Optional[Callable[[str], None]] = None) -> None:
    """``write(tmp)`` into a new temporary file beside ``path``, fsync, then rename it to ``path``;
    the temporary file is removed on failure. ``check(path)``, when given, runs right before the
    rename (what is at ``path`` may have changed since the caller first looked) and raises to keep
    it. The file's mode: see :func:`write_temp`. OSError is the caller's to name."""
    tmp = write_temp(path, write)
    try:
        if check is not None:
            check(path)
        os.replace(tmp, path)
    except BaseException:
        remove_temp(tmp)
        raise


def write_temp(path: str, write: Callable[[str], Any]) -> str:
    """``write(tmp)`` into a new temporary file beside ``path``, fsync'd; returns its name, for the
    caller to rename to ``path`` (an export renames its files only once all are written, so an
    interrupted one replaces nothing) or to remove. Removed here on failure (Ctrl-C included). The
    file gets the mode a new file gets here (``0o666`` less the umask, as ``torch.save``'s and
    ``save_pretrained``'s files): safetensors replaces the file it writes with a ``0600`` one, so the
    mode of the temporary file as created is put back."""
    tmp = temp_name(path)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o666)
    try:
        try:
            mode = stat.S_IMODE(os.fstat(fd).st_mode)  # 0o666 & ~umask (and any default ACL)
        finally:
            os.close(fd)
        write(tmp)
        fd = os.open(tmp, os.O_RDONLY | _NOFOLLOW)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise OSError(f"{tmp} is no longer the regular file written")
            os.fchmod(fd, mode)
            os.fsync(fd)
        finally:
            os.close(fd)
    except BaseException:
        remove_temp(tmp)
        raise
    return tmp


def remove_temp(tmp: str) -> None:
    """Remove the temporary file ``tmp`` of :func:`write_temp` if it is still there (never a link's target)."""
    if os.path.lexists(tmp):
        os.remove(tmp)


def make_dirs(path: str) -> List[str]:
    """``os.makedirs(path, exist_ok=True)``; returns the directories it made, deepest first, for
    :func:`remove_made_dirs` to take back when what was to be written there was not: an interrupted
    export leaves no empty directory at its output's name (nor empty parents)."""
    missing = missing_dirs(path)
    os.makedirs(os.path.abspath(path), exist_ok=True)  # abspath: "" (the working directory) is no error
    return missing


def missing_dirs(path: str) -> List[str]:
    """The directories ``os.makedirs(path)`` would make now, deepest first (nothing is made)."""
    missing: List[str] = []
    p = os.path.abspath(path)
    while not os.path.lexists(p) and os.path.dirname(p) != p:
        missing.append(p)
        p = os.path.dirname(p)
    return missing


def remove_made_dirs(made: List[str]) -> None:
    """Remove the directories :func:`make_dirs` made, deepest first, while they are empty (``rmdir``:
    anything put there since, by anyone, keeps its directory and those above it)."""
    for d in made:
        try:
            os.rmdir(d)
        except OSError:
            return


def check_torch_file_target(path: str) -> None:
    """Refuse (ArgumentError naming it) an existing ``path`` that a ``torch.save`` output must not
    replace: anything but a regular file that is a ``torch.save`` archive or empty. A link is refused, not
    followed (the rename would replace the link, never its target, so the user would lose the link
    and keep a stale target). Nothing at ``path`` is fine."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    except OSError as e:
        raise ArgumentError(f"{path}: cannot check what is there ({e.strerror or e}); nothing was written") from None
    if stat.S_ISDIR(st.st_mode):
        raise ArgumentError(f"{path}: is a directory; give a file name for the torch.save output")
    if stat.S_ISLNK(st.st_mode):
        raise ArgumentError(f"{path}: exists and is a symbolic link; refusing to replace it (a torch.save output "
                            "replaces only a torch.save file): give the link's target or another name")
    what = None if stat.S_ISREG(st.st_mode) else "not a regular file"
    if what is None and st.st_size and not is_torch_archive(path):  # empty: nothing to lose (a mkstemp name)
        what = "not a torch.save file"
    if what is not None:
        raise ArgumentError(f"{path}: exists and is {what}; refusing to replace it (a torch.save output replaces "
                            "only a torch.save file): move it away or give another name")


def is_torch_archive(path: str) -> bool:
    """A zip archive as ``torch.save`` writes one: every record under one folder, ``<folder>/data.pkl``
    among them. Only the zip directory is read (a file of any size is checked in milliseconds)."""
    try:
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        return False
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode) or f.read(4) != b"PK\x03\x04":
            return False
        try:
            with zipfile.ZipFile(f) as archive:
                names = archive.namelist()
        except (zipfile.BadZipFile, NotImplementedError, OSError, ValueError, EOFError, OverflowError):
            return False
    folders = {n.split("/", 1)[0] for n in names}
    return len(folders) == 1 and all("/" in n for n in names) and f"{folders.pop()}/data.pkl" in names
