"""Durable, atomic commit: ranks write into a hidden staging directory beside the target; rank 0
writes ``metadata.json`` and the commit marker after every rank has finished and fsync'd, then
swaps the staging directory into place. A crash at any point leaves the previous checkpoint intact
and never leaves a directory that looks complete but is not. ``s3://`` targets commit without a
rename, by a marker naming the version (:mod:`.s3`)."""

from __future__ import annotations

import ctypes
import errno
import hashlib
import json
import os
import shutil
from typing import Optional

from ..core.errors import CheckpointingError
from . import s3
from .checksums import sha256_hex
from .layout import COMMIT_MARKER, COMMON_FILE, METADATA_FILE, is_our_committed_checkpoint
from .options import StorageOptions
from .s3_url import is_s3_url
from .safe_pickle import write_file_durable
from .staging import remove_owner_notes

_RENAME_EXCHANGE = 2

def check_target(target: str, options: Optional[StorageOptions] = None) -> None:
    """Refuse to replace anything but a committed checkpoint of ours or an empty directory.

    Whatever else a directory holds (a ``data/`` folder included) may be a user's files: a save
    never removes them. Checked before anything is written, and again right before the swap.
    An ``s3://`` target: the bucket answers and holds no foreign marker (:func:`.s3.check_target`)."""
    if is_s3_url(target):
        s3.check_target(target, options or StorageOptions())
        return
    if not os.path.lexists(target):
        return
    if os.path.islink(target) or not os.path.isdir(target):
        raise CheckpointingError(f"checkpoint {target}: exists and is not a directory; refusing to replace it")
    if os.listdir(target) and not is_our_committed_checkpoint(target):
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
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree_dirs(root: str) -> None:
    """fsync every directory under ``root`` so new entries survive a crash (file data is fsync'd
    by whoever wrote it)."""
    for dirpath, _, _ in os.walk(root):
        fsync_dir(dirpath)


def _exchange(a: str, b: str) -> bool:
    """Atomically swap two paths with renameat2(RENAME_EXCHANGE); False where unsupported."""
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


def commit(staging: str, target: str, metadata_json: str, marker_json: str,
           options: Optional[StorageOptions] = None) -> None:
    """Write metadata and marker into ``staging`` and move it to ``target`` (rank 0 only).

    The marker gets the SHA-256 of ``metadata.json`` and of ``common.pt`` as written (read back from
    the staging directory: what is verified on load is what is on disk). An ``s3://`` target:
    ``staging`` is a version location, committed by :func:`.s3.commit`."""
    if is_s3_url(target):
        s3.commit(staging, metadata_json, marker_json, options or StorageOptions())
        return
    remove_owner_notes(staging)
    metadata = metadata_json.encode()
    write_file_durable(os.path.join(staging, METADATA_FILE), metadata)
    fsync_tree_dirs(staging)
    marker = json.loads(marker_json)
    marker["metadata_sha256"] = sha256_hex(metadata)
    marker["common_sha256"] = _file_sha256(os.path.join(staging, COMMON_FILE))
    write_file_durable(os.path.join(staging, COMMIT_MARKER), json.dumps(marker).encode())
    fsync_dir(staging)
    parent = os.path.dirname(os.path.abspath(target))
    if os.path.lexists(target):
        check_target(target)  # re-check: something may have appeared while we wrote
        if _exchange(staging, target):
            shutil.rmtree(staging, ignore_errors=True)  # now holds the old checkpoint
        else:
            old = staging + ".old"
            os.rename(target, old)
            os.rename(staging, target)
            shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(staging, target)
    fsync_dir(parent)

