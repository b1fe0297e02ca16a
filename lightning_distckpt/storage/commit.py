"""Durable, atomic commit: ranks write into a hidden staging directory beside the target; rank 0
writes ``metadata.json`` and the commit marker after every rank has finished and fsync'd, then
swaps the staging directory into place. A crash at any point leaves the previous checkpoint intact
and never leaves a directory that looks complete but is not; where the swap takes two renames (no
``RENAME_EXCHANGE``: NFS, Lustre), a crash between them leaves the new checkpoint committed beside
its missing target, and the next load, save or ``clean`` renames it into place
(:func:`recover_interrupted_commit`). The local store (:mod:`.local_store`) calls this module; an
object store commits without a rename (:mod:`.s3`)."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import signal
import threading
from concurrent.futures import Future
from typing import AbstractSet, Any, Callable, List, NamedTuple, Optional, Tuple

from ..core.errors import CheckpointingError, naming_file
from .checksums import sha256_hex
from .layout import COMMIT_MARKER, COMMON_FILE, DATA_DIR, METADATA_FILE, is_our_committed_checkpoint
from .paths import MARKER_CAP, holds_nothing, read_inside
from .safe_pickle import write_file_durable
from .swap import NO_EXCHANGE_ENV, exchange_paths  # noqa: F401 (NO_EXCHANGE_ENV: tests set it)
from .workers import KeptWorkers
from .output_files import is_torch_archive
from .remove_tree import remove_tree
from .stock_checkpoints import USER_TORCH_FILE, is_stock_dcp_dir, is_stock_lightning_file
from .staging import (OWNERS_DIR, STAGING_TAG, commit_time, is_removal_aside, is_staging_dir, live_owner_pids,
                      names_target, remove_owner_notes)

logger = logging.getLogger(__name__)
# For tests only: a comma-separated list of commit steps (see _step) at which the committing process
# SIGKILLs itself (..._KILL_AT) or stops itself with SIGSTOP for the test to resume (..._STOP_AT).
KILL_AT_ENV, STOP_AT_ENV = "LIGHTNING_DISTCKPT_TEST_KILL_AT", "LIGHTNING_DISTCKPT_TEST_STOP_AT"
COMMIT_STEPS = ("after_metadata", "after_marker", "after_notes_removed", "after_exchange", "after_first_rename",
                "after_rename_in", "after_cleanup")
_SWAP_TRIES = 8  # each retry follows another process's rename (a rank recovering, a second save)


class Recovery(NamedTuple):
    """What :func:`recover_interrupted_commit` did: the copy it renamed into place, what it removed."""

    placed: str
    removed: Tuple[str, ...]


def _step(name: str) -> None:
    """Test hook: stop or kill this process at the commit step ``name`` when the environment says so."""
    for env, sig in ((STOP_AT_ENV, signal.SIGSTOP), (KILL_AT_ENV, signal.SIGKILL)):
        if name in os.environ.get(env, "").split(","):
            os.kill(os.getpid(), sig)


def check_target(target: str) -> None:
    """Refuse to replace anything but a committed checkpoint of ours, an empty directory, or a stock
    Lightning checkpoint (:mod:`.stock_checkpoints`: a DCP directory ``ModelParallelStrategy`` wrote or a
    file ``TorchCheckpointIO`` wrote; the ``last.ckpt`` of a run moved to ours, which stock saves over too).

    Whatever else a directory holds (a ``data/`` folder included) may be a user's files: a save
    never removes them. Checked before anything is written, and again right before the swap."""
    if not os.path.lexists(target) and recover_interrupted_commit(target) is None:
        return
    if is_stock_lightning_file(target):  # a stock DDP run's last.ckpt: stock would write over it too
        return
    if os.path.islink(target) or not os.path.isdir(target):
        what = f"{USER_TORCH_FILE}: " if is_torch_archive(target) else ""
        raise CheckpointingError(f"checkpoint {target}: exists and is not a directory ({what}a checkpoint of ours is "
                                 "a directory); refusing to replace it: move it away, or save elsewhere")
    if os.listdir(target) and not is_our_committed_checkpoint(target) and not is_stock_dcp_dir(target):
        raise CheckpointingError(
            f"checkpoint {target}: directory exists, is not empty and is not a committed lightning_distckpt "
            f"checkpoint; refusing to replace it (move its contents away, or save elsewhere)"
        )


def _file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()


def fsync_dir(path: str) -> None:
    """fsync ``path``: a directory (its entries) or a file (its data)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        with naming_file(path):
            os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree_dirs(root: str, skip: Callable[[str], bool] = lambda path: False) -> None:
    """fsync every directory under ``root`` (``root`` included) once, so new entries survive a crash
    (file data is fsync'd by whoever wrote it); directories for which ``skip(path)`` holds are left
    out with everything under them."""
    for dirpath, dirnames, _ in os.walk(root):
        dirnames[:] = [d for d in dirnames if not skip(os.path.join(dirpath, d))]
        fsync_dir(dirpath)


_SYNC_THREADS = 16  # files fsync'd at once: each waits for the journal, they share its commits


# The helper threads of :func:`fsync_all` and :func:`in_background`, kept between saves (starting
# 3 threads per rank store and save cost ~0.4 ms of CPU, 2 MB state); see :mod:`.workers`.
_SYNC_POOL = KeptWorkers("distckpt-fsync", _SYNC_THREADS - 1)


def in_background(fn: Callable[[], Any]) -> "Optional[Future[Any]]":
    """``fn`` started on a thread of the kept pool; None where the pool takes no more work (the
    interpreter is shutting down: an async save finished at exit), and the caller runs it itself."""
    return _SYNC_POOL.submit(fn)


def fsync_tree(root: str, skip: AbstractSet[str] = frozenset()) -> List[str]:
    """fsync every file (but those in ``skip``, durable and unchanged since) and every directory
    under ``root`` (``root`` included), all at once (:func:`fsync_all`); returns the files synced.
    The directories go with the files, not after them: each fsync makes durable what is there when
    it runs (a directory its entries, a file its data), the files and their entries all exist
    before this is called, and nothing after it relies on an order among them, only on all being
    done when it returns (before the commit marker; :func:`commit`)."""
    dirs: List[str] = []
    files: List[str] = []
    for dirpath, _, filenames in os.walk(root):
        dirs.append(dirpath)
        files += [path for path in (os.path.join(dirpath, name) for name in filenames) if path not in skip]
    fsync_all(dirs + files)
    return files


def fsync_all(paths: List[str]) -> None:
    """fsync every one of ``paths`` (files or directories) at once: concurrent fsyncs share the file
    system's journal commits, so a few cost about one. Returns when all are done; raises the first
    OSError. The calling thread takes its share and, where no helper thread of the pool comes (the
    interpreter is shutting down and the pool takes no more work, e.g. an async save finished at
    exit; or a forked child, whose pool has no threads), does them all itself."""
    errors: List[Exception] = []
    pending = list(reversed(paths))
    busy = [0]  # paths a helper has taken and not finished
    changed = threading.Condition()

    def work() -> None:
        while True:
            with changed:
                if not pending:
                    return
                path = pending.pop()
                busy[0] += 1
            try:
                fsync_dir(path)
            except Exception as e:  # raised by the caller below, whichever thread met it
                errors.append(e)
            finally:
                with changed:
                    busy[0] -= 1
                    changed.notify_all()

    for _ in range(min(_SYNC_THREADS, len(paths)) - 1):
        if in_background(work) is None:  # a helper that comes after the last path was taken returns at once
            break  # the pool takes no more work: this thread does them
    work()
    with changed:
        changed.wait_for(lambda: busy[0] == 0)
    if errors:
        raise errors[0]


def _made_durable_elsewhere(staging: str) -> Callable[[str], bool]:
    """The directories of ``staging`` the commit need not fsync: ``data/`` and the rank stores in it,
    fsync'd by their writers before they reported success (a ``ShardWriter``'s write is durable when
    it returns, entries up to ``data/`` included), so rank 0 does not walk every rank's store one
    fsync at a time; and the owner notes, hints that are removed before the rename."""
    skipped = {os.path.join(staging, DATA_DIR), os.path.join(staging, OWNERS_DIR)}
    return skipped.__contains__


def commit(staging: str, target: str, metadata_json: str, marker_json: str, entries_synced: bool = False) -> None:
    """Write metadata and marker into ``staging`` and move it to ``target`` (rank 0 only).

    The marker gets the SHA-256 of ``metadata.json`` and of ``common.pt`` as written (read back from
    the staging directory: what is verified on load is what is on disk). The owner notes of every
    rank stay until the marker is written (until then ``clean`` sees a running save; from then on a
    committed copy, which it keeps while it is newer than the target) and are removed before the
    rename.

    fsyncs on the way (each waits for the file system's journal): the marker, then the staging
    directory (its entry and the notes' removal, already in the marker's journal commit on ext4 and
    XFS), the parent after the rename. Before them, what the marker covers must be durable: the
    files are fsync'd by their writers, the rank stores' entries by their writers (under ``data/``),
    and the staging directory's own entries either here (one fsync of each directory outside
    ``data/``) or, when ``entries_synced``, already by the save (``LocalStore.write_blob`` fsyncs
    the directory after each blob, and ``data/`` is made before any: nothing is added later)."""
    metadata = metadata_json.encode()
    if not _holds(os.path.join(staging, METADATA_FILE), metadata):  # the save writes it beside its shards
        write_file_durable(os.path.join(staging, METADATA_FILE), metadata)
        entries_synced = False
    if not entries_synced:
        fsync_tree_dirs(staging, _made_durable_elsewhere(staging))
    _step("after_metadata")
    marker = json.loads(marker_json)
    marker["metadata_sha256"] = sha256_hex(metadata)
    marker["common_sha256"] = _file_sha256(os.path.join(staging, COMMON_FILE))
    marker_bytes = json.dumps(marker).encode()
    marker_path = os.path.join(staging, COMMIT_MARKER)
    with naming_file(marker_path), open(marker_path, "wb") as f:
        f.write(marker_bytes)
        f.flush()
        _step("after_marker")
        # The notes go once the marker is there (a running clean sees one or the other, never
        # neither), before it is durable: its fsync then makes the marker, its entry and the notes'
        # removal durable in one journal commit, and the directory's fsync after it finds little left
        # to do. A crash before both leaves an uncommitted staging directory (notes or not, its
        # processes are gone), never a committed one with notes; the rename waits for both.
        remove_owner_notes(staging)
        os.fsync(f.fileno())
    try:
        fsync_dir(staging)
    except FileNotFoundError:  # a missing target's recovery (clean, a loading rank) renamed it into place already
        if not _holds_marker(target, marker_bytes):
            raise
    _step("after_notes_removed")
    _swap_in(staging, target, marker_bytes)
    fsync_dir(os.path.dirname(os.path.abspath(target)))
    _step("after_cleanup")


def _holds(path: str, data: bytes) -> bool:
    """``path`` (in our own staging directory) is a file holding exactly ``data``, written durably
    by the save (``saving/save_commit.py``: rank 0 writes metadata.json beside its shards)."""
    try:
        with open(path, "rb") as f:
            return f.read(len(data) + 1) == data
    except OSError:
        return False


_RACES = (errno.ENOENT, errno.EEXIST, errno.ENOTEMPTY)  # another process renamed first


def _swap_in(staging: str, target: str, marker: bytes) -> None:
    """Move the committed ``staging`` to ``target``, replacing what is there (a committed checkpoint
    of ours or an empty directory). Another process may finish the move first
    (:func:`recover_interrupted_commit`, run by a rank loading meanwhile): a rename that then fails
    is fine once ``target`` holds our marker. The previous checkpoint is removed only once ours is
    in place; on any other error it is put back."""
    olds: List[str] = []  # where the previous checkpoint was moved aside (two-rename path)
    for attempt in range(_SWAP_TRIES + 1):
        if _holds_marker(target, marker):  # in place: ours, or another process finished the move
            break
        if attempt == _SWAP_TRIES:
            _put_back(olds, target)
            raise CheckpointingError(f"checkpoint {target}: could not rename {staging} into place: {target} kept "
                                     f"changing under the commit ({_SWAP_TRIES} tries)")
        try:
            _swap_once(staging, target, attempt, olds)
            break
        except OSError as e:
            if e.errno not in _RACES:
                _put_back(olds, target)
                raise
    for old in olds:  # the previous checkpoint, moved aside (unless a recovery removed it already)
        _remove(old)


def _swap_once(staging: str, target: str, attempt: int, olds: List[str]) -> None:
    """One try at the swap: a rename where nothing is at ``target``, else renameat2(RENAME_EXCHANGE),
    else two renames (``target`` aside to ``olds[-1]``, ``staging`` in)."""
    if not os.path.lexists(target):
        os.rename(staging, target)
        _step("after_rename_in")
        return
    check_target(target)  # re-check: something may have appeared while we wrote
    if exchange_paths(staging, target):
        _step("after_exchange")
        _recheck(staging, target, lambda: exchange_paths(staging, target))  # what the name held at the exchange
        _remove(staging)  # now holds the old checkpoint
        return
    olds.append(f"{staging}.old" + (str(attempt) if attempt else ""))
    os.rename(target, olds[-1])
    _recheck(olds[-1], target, lambda: _put_back(olds, target))
    _step("after_first_rename")
    os.rename(staging, target)
    _step("after_rename_in")


def _recheck(moved: str, target: str, put_back: Callable[[], Any]) -> None:
    """What the swap moved out of ``target`` (to ``moved``) is what ``check_target`` lets a save replace:
    the name may have been given to something else since that check. If not, ``put_back()`` and raise."""
    try:
        ok = is_stock_lightning_file(moved) or (os.path.isdir(moved) and not os.path.islink(moved) and (
            not os.listdir(moved) or is_our_committed_checkpoint(moved) or is_stock_dcp_dir(moved)))
    except OSError:
        ok = False
    if not ok:
        put_back()  # an exchange back leaves our new checkpoint at ``moved``: what is not ours is at ``target``
        where = moved if os.path.lexists(moved) and not is_our_committed_checkpoint(moved) else target
        raise CheckpointingError(f"checkpoint {target}: changed between the check and the swap into place, to "
                                 f"something a save does not replace; left at {where}, the new checkpoint not put "
                                 "in place")


def _put_back(olds: List[str], target: str) -> None:
    """After a failed swap: the previous checkpoint back at ``target`` if nothing took its place."""
    if olds and not os.path.lexists(target):
        try:
            os.rename(olds[-1], target)
        except OSError:
            return  # left where it is: recover_interrupted_commit finds it
        olds.pop()


def _holds_marker(path: str, marker: bytes) -> bool:
    """``path`` holds the commit marker ``marker`` (our commit is in place)."""
    try:
        return read_inside(os.path.join(path, COMMIT_MARKER), "commit marker", max_bytes=MARKER_CAP) == marker
    except (OSError, CheckpointingError):
        return False


def _committed_copies(target: str) -> List[Tuple[float, str]]:
    """Staging directories beside ``target`` (``.old`` copies included) holding a committed
    checkpoint of ours, as (commit time, path), newest first."""
    parent, name = os.path.split(target)
    try:
        names = os.listdir(parent)
    except OSError:
        return []
    copies = []
    for entry in names:
        if STAGING_TAG not in entry or not is_staging_dir(entry) or is_removal_aside(entry):  # (one being removed)
            continue
        path = os.path.join(parent, entry)
        if not names_target(path, name) or os.path.islink(path):
            continue
        when = commit_time(path) if os.path.isdir(path) and is_our_committed_checkpoint(path) else None
        if when is not None:
            copies.append((when, path))
    return sorted(copies, reverse=True)


def recover_interrupted_commit(target: str) -> Optional[Recovery]:
    """Finish a commit interrupted between its two renames (file systems without
    ``RENAME_EXCHANGE``, or a first save killed before its rename): when nothing is at ``target``
    (or only an empty directory, an async save's placeholder: :func:`~.paths.holds_nothing`; or
    ``target`` is a link to either) and a staging directory beside it holds a committed
    checkpoint of ours, the newest such copy (by its marker's ``committed_unix``) is renamed into
    place and the previous checkpoint that commit moved aside (``.old``) is removed; a WARNING says
    so. A copy a live process on this host is still committing is left to it.

    Safe to call from several processes at once (ranks loading together): renames are atomic, the
    losers see the target in place and return. File-system operations only, no collectives. A
    rename the file system refuses (permissions) is logged, and None returned."""
    path = os.path.abspath(target)
    if os.path.islink(path):
        path = os.path.realpath(path)  # a dangling link (save_last="link"): its checkpoint's copy
    for _ in range(_SWAP_TRIES):
        if not holds_nothing(path):  # an empty directory: an async save's placeholder, killed before its swap
            return None
        copies = _committed_copies(path)
        if not copies or live_owner_pids(copies[0][1]):
            return None
        when, best = copies[0]
        remove_owner_notes(best)  # its commit was killed before removing them
        try:
            os.rename(best, path)
        except OSError as e:
            if e.errno in _RACES:
                continue  # another process moved it or put something in place: look again
            logger.warning("checkpoint %s is missing and could not be recovered from %s: %s", path, best, e)
            return None  # the caller reports the missing checkpoint, naming the stranded copy
        fsync_dir(os.path.dirname(path))
        removed = tuple(p for t, p in copies[1:]
                        if t <= when and _is_moved_aside(p) and not live_owner_pids(p) and _remove(p))
        logger.warning("checkpoint %s was missing: a commit was interrupted before its rename into place; renamed "
                       "the committed copy %s (committed at unix time %.3f) into place%s", path, best, when,
                       f" and removed the previous checkpoint moved aside ({', '.join(removed)})" if removed else "")
        return Recovery(best, removed)
    return None


def _is_moved_aside(path: str) -> bool:
    """A previous checkpoint a commit moved aside: ``<staging>.old`` or ``<staging>.oldN``."""
    return os.path.basename(path).rpartition(STAGING_TAG)[2].partition(".")[2].startswith("old")


def _remove(path: str) -> bool:  # a replaced checkpoint: a directory, or a stock Lightning checkpoint file
    if os.path.isdir(path) and not os.path.islink(path):
        return remove_tree(path, f"the previous checkpoint {path}, replaced by a new one")
    else:
        with contextlib.suppress(OSError):
            os.remove(path)
    return not os.path.lexists(path)
