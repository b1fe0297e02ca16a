"""Which paths a checkpoint may be read from and written to, and how every reader opens a file.

* A path with a URL scheme (``gs://``, ``http://``, ``file://``, ...) is refused: no store for it
  exists yet, and treated as a local path it would be written to ``./gs:/bucket/...`` while the
  caller believes it is in the bucket. ``s3://`` locations are taken where
  :func:`checkpoint_location` is used (save and load; see :mod:`.s3`).
* Every file any reader opens (ours or another format's) is opened by :func:`open_regular`:
  non-blocking, then ``fstat``'d, and refused unless it is a regular file. A FIFO, socket, device or
  directory in place of a file is a FormatError naming it, never a read that waits forever. Trees
  handed to tensorstore are walked first (:func:`scan_tree`), refusing anything that is neither a
  regular file nor a directory; a file handed to a library that opens it by path (safetensors,
  ``torch.load`` with ``mmap``) is checked by :func:`check_regular` first.
* Links. Nothing under one of our checkpoint directories is followed through a symbolic link: its
  files are opened with ``O_NOFOLLOW`` and its data tree is walked (links not followed) before
  tensorstore reads it. A link elsewhere would make a load read another checkpoint's (or any
  file's) bytes as ours. In another format's directory (torch files, safetensors, Hugging Face
  with or without an index, DCP, Megatron-Core), a link is followed only when its real path stays
  inside the model's root (:func:`model_root`: the directory given, or for a Hugging Face cache
  snapshot ``.../models--org--name/snapshots/<rev>/`` the cache repo folder, whose ``blobs/`` the
  snapshot links into); any other link is a FormatError naming the link and its target. A single
  file the user names is read wherever its link points (:data:`ANYWHERE`: the user chose it). The
  directory given (ours or another format's) may itself be reached through links (a symlinked
  parent, the ``last.ckpt`` link of Lightning's ``save_last="link"``): readers resolve it once, to
  its real path.

* Sizes. A file read whole (or handed to tensorstore, which reads it whole) is refused before it
  is read when it is larger than its :class:`SizeCap` (all of them below :func:`read_inside`): a
  sparse file of 100 GB costs a hostile checkpoint nothing.

File-system queries only; no collectives. The checks are made before reading and do not guard
against a link or file swapped in while a load runs (whoever can do that can also rewrite the data).
"""

from __future__ import annotations

import os
import re
import stat
from typing import BinaryIO, Callable, NamedTuple, Optional, Tuple, Union

from ..core.errors import ArgumentError, ArgumentTypeError, FormatError

PathLike = Union[str, "os.PathLike[str]"]

_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*://")
# ``root`` of a file the user named: wherever its link points is inside it.
ANYWHERE = os.path.abspath(os.sep)
_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)


def path_text(path: PathLike, what: str) -> str:
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
    """``path`` as a string (see :func:`path_text`: the one check of every path argument), refused
    with ArgumentError when it is a URL rather than a local path."""
    text = path_text(path, what)
    if _SCHEME.match(text):
        raise ArgumentError(f"{what} {text}: URLs are not supported here; give a local or shared file-system path "
                            f"(it would otherwise be written to a local directory named {text.split('://', 1)[0]}:)")
    return text


def checkpoint_location(path: PathLike, what: str = "checkpoint") -> str:
    """Where a checkpoint is, normalized by the store that serves it (an ``s3://`` URL, or a local
    path made absolute; other URLs refused; ``what`` names the argument in errors). Decided by the
    path alone, so every rank decides alike (credentials, which may differ by rank, are checked
    where failures are agreed). The store is picked by :func:`~.stores.store_class`."""
    from .stores import store_class  # the factory imports the stores, which import this module

    text = path_text(path, what)
    return store_class(text).normalize(text, what)


def local_location(text: str, what: str = "checkpoint") -> str:
    """A local checkpoint path made absolute; any URL refused (ArgumentError naming ``what``). A
    backslash is an ArgumentError: tensorstore, which opens our arrays, reads it as a separator, so
    ``a\\b`` would be written to ``a/b``."""
    if _SCHEME.match(text):
        scheme = text.split("://", 1)[0]
        raise ArgumentError(f"{what} {text}: {scheme}:// URLs are not supported; a checkpoint goes to a local or "
                            f"shared file-system path or to an s3:// URL (it would otherwise be written to a local "
                            f"directory named {scheme}:)")
    location = os.path.abspath(local_path(text, what))
    if "\\" in location:
        raise ArgumentError(f"{what} {text}: a path with a backslash is refused: tensorstore reads it as a "
                            "separator and would write elsewhere; rename it")
    return location


def holds_nothing(path: str) -> bool:
    """Nothing is at ``path``, or an empty directory (not a link): the name a background save holds
    until its commit swaps the checkpoint in (``saving/async_pending.py``), left empty by a job killed
    first. A committed copy is renamed into place over it as over nothing (a rename replaces an empty
    directory atomically, and fails if anything appeared in it)."""
    if not os.path.lexists(path):
        return True
    if os.path.islink(path) or not os.path.isdir(path):
        return False
    try:
        return not os.listdir(path)
    except OSError:
        return False


def dir_identity(path: str) -> Optional[Tuple[int, int]]:
    """(device, inode) of what is at ``path`` (links followed; None when nothing): a save committing to
    that path swaps another directory in, so a change tells a replaced checkpoint from a damaged one."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino)


def kind_of(mode: int) -> str:
    """What a file of ``st_mode`` ``mode`` is, in words (for errors)."""
    for test, name in ((stat.S_ISREG, "a regular file"), (stat.S_ISDIR, "a directory"),
                       (stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return f"a special file (mode {mode:#o})"


def _not_regular(path: str, what: str, mode: int) -> FormatError:
    return FormatError(f"{what} {path} is {kind_of(mode)}, not a regular file; refused")


def refuse_link(path: str, what: str) -> os.stat_result:
    """``lstat`` of ``path``; FormatError when it is a symbolic link (OSError when missing)."""
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise FormatError(
            f"{what} {path} is a symbolic link (to {os.readlink(path)}); refused: nothing inside a checkpoint "
            f"is followed through a link"
        )
    return st


def refuse_special(path: str, what: str) -> os.stat_result:
    """``lstat`` of ``path``; FormatError when it is a symbolic link or anything but a regular file
    (OSError when missing). Opens nothing: for entries a reader only looks at."""
    st = refuse_link(path, what)
    if not stat.S_ISREG(st.st_mode):
        raise _not_regular(path, what, st.st_mode)
    return st


def model_root(directory: str) -> str:
    """The real path a link in another format's directory ``directory`` may resolve into: the
    directory itself, or, for a Hugging Face cache snapshot (``.../snapshots/<rev>/`` with a
    ``blobs/`` folder two levels up), the cache repo folder (``models--org--name``)."""
    real = os.path.realpath(directory)
    parent = os.path.dirname(real)
    repo = os.path.dirname(parent)
    if os.path.basename(parent) == "snapshots" and os.path.isdir(os.path.join(repo, "blobs")):
        return repo
    return real


def resolve_within(path: str, what: str, root: str) -> str:
    """The real path of ``path``, which must lie inside ``root`` (a FormatError naming the link and
    its target otherwise). ``root`` :data:`ANYWHERE` admits every path."""
    real = os.path.realpath(path)
    if root == ANYWHERE:
        return real
    base = os.path.realpath(root)
    if real == base or real.startswith(base.rstrip(os.sep) + os.sep):
        return real
    link = f" (a symbolic link to {os.readlink(path)})" if os.path.islink(path) else ""
    raise FormatError(
        f"{what} {path}{link} resolves to {real}, outside {base}; refused: a link is followed only when it "
        f"stays inside the model's directory (or its Hugging Face cache repo)"
    )


def open_regular(path: str, what: str, root: Optional[str] = None) -> int:
    """A blocking file descriptor of the regular file ``path`` (close it). ``root`` None: ``path``
    is not followed through a link (our checkpoints); else a link is followed when its real path
    is inside ``root`` (:func:`resolve_within`). Anything that is not a regular file (FIFO, socket,
    device, directory) is a FormatError naming it, found by ``lstat`` before it is opened (opening a
    device can act on it); the open itself is non-blocking and ``fstat``'d, so a FIFO swapped in
    meanwhile does not wait for a writer either. A missing or unreadable file raises OSError
    (callers name it)."""
    target = path if root is None else resolve_within(path, what, root)
    mode = refuse_link(path, what).st_mode if root is None else os.lstat(target).st_mode
    if not stat.S_ISREG(mode):
        raise _not_regular(path, what, mode)
    fd = os.open(target, _OPEN_FLAGS)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise _not_regular(path, what, mode)
        os.set_blocking(fd, True)
        return fd
    except BaseException:
        os.close(fd)
        raise


def check_regular(path: str, what: str, root: Optional[str] = None) -> os.stat_result:
    """The ``stat`` of ``path`` after :func:`open_regular` accepted it: call before handing ``path``
    to a library that opens it by name (safetensors' ``safe_open``, ``torch.load`` with ``mmap``)."""
    fd = open_regular(path, what, root)
    try:
        return os.fstat(fd)
    finally:
        os.close(fd)


def open_inside(path: str, what: str, root: Optional[str] = None) -> BinaryIO:
    """:func:`open_regular` as a binary file object (close it)."""
    return os.fdopen(open_regular(path, what, root), "rb")


class SizeCap(NamedTuple):
    """The most bytes a file that a reader reads whole (or hands to tensorstore, which does) may hold.
    A hostile checkpoint may hold a sparse file of 100 GB that costs its maker nothing; read whole
    it would take all the memory. Checked against the file's size before anything is read.
    ``env`` names the environment variable that raises the cap ("" for caps no real file nears)."""

    kind: str  # what such a file is, for errors
    default: int
    env: str = ""

    def limit(self) -> int:
        """The cap: ``default``, or the value of ``env`` when set (bytes; ArgumentError when it is
        not a positive integer, so that a typo does not silently keep the default)."""
        text = os.environ.get(self.env, "").strip() if self.env else ""
        if not text:
            return self.default
        try:
            value = int(text.replace("_", ""))
        except ValueError:
            value = 0
        if value <= 0:
            raise ArgumentError(f"{self.env}={text!r}: give the most bytes a {self.kind} may hold, a positive integer")
        return value

    def check(self, size: int, path: str, what: str) -> None:
        """FormatError naming ``path``, ``size`` and the cap when ``size`` exceeds it."""
        limit = self.limit()
        if size > limit:
            raise self.refusal(f"{what} {path}", size, limit)

    def refusal(self, where: str, size: Optional[int], limit: int) -> FormatError:
        """The FormatError refusing the file ``where`` of ``size`` bytes (None: not known, only that
        it is more) past the cap ``limit``."""
        held = f"{size} bytes, more than the {limit}" if size is not None else f"more than the {limit} bytes"
        hint = f"; if the file is real, set {self.env} to a larger number of bytes" if self.env else ""
        return FormatError(f"{where} holds {held} a {self.kind} may hold; refused before reading it "
                           f"(damaged or hostile{hint})")


# Every cap on a file read whole, in one place (docs/format.md, "Trust boundary", lists them).
#: COMMITTED holds a few hundred bytes; tiers-last.json and other small notes as much.
MARKER_CAP = SizeCap("commit marker", 1 << 20)
#: metadata.json (2.4 MB for 4,096 Megatron-like ranks; hundreds of MB at 16k ranks and many
#: tensors) and another format's index (a DCP ``.metadata`` pickle).
METADATA_CAP = SizeCap("checkpoint index (metadata.json, DCP .metadata)", 1 << 30,
                       "LIGHTNING_DISTCKPT_MAX_METADATA_BYTES")
#: Pickled state read whole: common.pt (options, loops, RNG states: kB to MB; format 5 kept plain
#: tensors there too) and a ShardedObject element stored as a file of its own.
PICKLE_CAP = SizeCap("pickled state file (common.pt, a ShardedObject)", 4 << 30, "LIGHTNING_DISTCKPT_MAX_COMMON_BYTES")
#: What tensorstore reads whole before a rank's arrays: each zarr.json (kB; chunk CRC lists of
#: thousands of chunks in tens of kB) and an OCDBT ``manifest.ocdbt`` (kB).
STORE_INDEX_CAP = SizeCap("store index file (zarr.json, manifest.ocdbt)", 64 << 20)
#: Other formats' small files read whole: Megatron-Core's ``metadata.json`` (~100 bytes), a Hugging
#: Face ``*.index.json`` (a weight map: ~100 kB at hundreds of shards), a safetensors header (one
#: entry per tensor: a few MB at tens of thousands of tensors).
MEGATRON_CONFIG_CAP = SizeCap("Megatron-Core metadata.json", 1 << 20)
HF_INDEX_CAP = SizeCap("Hugging Face index", 64 << 20)
SAFETENSORS_HEADER_BYTES = 100 << 20
#: A torch file's compressed zip records (torch writes none) may inflate to at most this many times
#: the archive's bytes, or the floor, in all (the budget its tensors' views get: reading/formats/files.py).
INFLATED_FACTOR, INFLATED_FLOOR = 4, 1 << 30
#: Beyond a writer's claimed tensor bytes, what one chunk file of a plain-zarr store may hold more
#: (an older writer's edge chunk padded to a whole chunk; the CRC codec's 4 bytes).
CHUNK_FILE_SLACK = 256 << 20


def read_inside(path: str, what: str, root: Optional[str] = None,
                max_bytes: Union[int, SizeCap, None] = None) -> bytes:
    """The bytes of the regular file ``path`` (see :func:`open_regular`; by default never through a
    link: the files of our checkpoints). A file larger than ``max_bytes`` (bytes, or a
    :class:`SizeCap`) is a FormatError, raised before anything is read (and again should it grow
    past the cap while read). A link or special file is a FormatError; a missing or unreadable file
    raises OSError (callers name it)."""
    cap = max_bytes if isinstance(max_bytes, SizeCap) or max_bytes is None else SizeCap("file read here", max_bytes)
    fd = open_regular(path, what, root)
    try:
        if cap is not None:
            cap.check(os.fstat(fd).st_size, path, what)
        chunks, total = [], 0
        while True:
            chunk = os.read(fd, 1 << 24)
            if not chunk:
                return b"".join(chunks)
            total += len(chunk)
            if cap is not None:
                cap.check(total, path, what)
            chunks.append(chunk)
    finally:
        os.close(fd)


class TreeStats(NamedTuple):
    """What a walk of a directory tree found: its regular files and their bytes."""

    files: int
    nbytes: int


def scan_tree(root: str, what: str, check: Optional[Callable[[str, int], None]] = None) -> TreeStats:
    """Count the regular files under the directory ``root`` and their bytes, refusing ``root`` or
    anything in it that is a symbolic link, or neither a regular file nor a directory (a FIFO, a
    socket, a device: FormatError naming it), so that tensorstore, which opens what it finds
    without such checks, is never handed one. ``check(path, size)`` is called for each regular
    file (to refuse one too large to be read whole). OSError when ``root`` is missing or unreadable."""
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
                    continue
                st = entry.stat(follow_symlinks=False)
                if not stat.S_ISREG(st.st_mode):
                    raise _not_regular(entry.path, f"{what}: file", st.st_mode)
                if check is not None:
                    check(entry.path, st.st_size)
                files += 1
                nbytes += st.st_size
    return TreeStats(files, nbytes)
