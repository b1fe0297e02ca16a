"""Opening a checkpoint's files so that what is read can be trusted: the directory is resolved
once to its real path (a missing one is described with where a good checkpoint is), nothing inside
it is followed through a link, and the common state is read as a regular file of the checkpoint.
An ``s3://`` checkpoint is opened through its commit marker (:func:`.s3.open_metadata`): its path
is then the committed version's location.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Dict, Optional, Sequence

from ..core.errors import CheckpointingError, FormatError, not_found
from . import s3
from .checksums import check_sha256
from .commit import recover_interrupted_commit
from .layout import COMMON_FILE, DATA_DIR, MetadataFile, open_metadata, rank_dir
from .options import StorageOptions
from .paths import PathLike, checkpoint_location, read_inside, refuse_link, scan_tree
from .s3_url import is_s3_url
from .safe_pickle import loads
from .staging import describe_missing

if TYPE_CHECKING:
    from ..planning.metadata import CheckpointIndex


def open_checkpoint_metadata(checkpoint_dir: PathLike) -> MetadataFile:
    """The checked metadata of the committed checkpoint at ``checkpoint_dir`` (see
    :func:`~lightning_distckpt.storage.layout.open_metadata`); a missing directory (or a dangling
    ``last.ckpt`` link) says where the newest committed checkpoints are."""
    given = checkpoint_location(checkpoint_dir)
    if is_s3_url(given):
        return s3.open_metadata(given, StorageOptions())
    if not os.path.isdir(given):
        recover_interrupted_commit(given)  # a commit killed between its two renames: finish it
    if not os.path.isdir(given):
        raise not_found(given, describe_missing(given))
    return open_metadata(given)


def read_common(checkpoint_dir: str, marker: Dict[str, Any], extra_safe_globals: Sequence[Any] = ()) -> Any:
    """The common state (``common.pt``) of the checkpoint at the real path ``checkpoint_dir``,
    whose commit marker is ``marker``, deserialized safely."""
    where = f"checkpoint {checkpoint_dir}: {COMMON_FILE}"
    return loads(read_common_bytes(checkpoint_dir, marker), where, extra_safe_globals)


def read_common_bytes(checkpoint_dir: str, marker: Dict[str, Any]) -> bytes:
    """The bytes of ``common.pt``, read as a regular file of the checkpoint and checked against the
    SHA-256 its commit marker records (a copy made from them is then no copy of damage)."""
    path = os.path.join(checkpoint_dir, COMMON_FILE)
    where = f"checkpoint {checkpoint_dir}: {COMMON_FILE}"
    try:
        blob = (s3.read_object(checkpoint_dir, COMMON_FILE, StorageOptions()) if is_s3_url(checkpoint_dir)
                else read_inside(path, f"checkpoint {checkpoint_dir}:"))
    except FileNotFoundError:
        raise CheckpointingError(f"{where} is missing") from None
    except OSError as e:
        raise CheckpointingError(f"{where} cannot be read: {e.strerror or e}") from None
    if blob is None:
        raise CheckpointingError(f"{where} is missing")
    if not blob:
        raise FormatError(f"{where} is empty (0 bytes)")
    if "common_sha256" in marker:
        check_sha256(blob, marker["common_sha256"], where)
    return blob


def store_bytes(checkpoint_dir: str, writer: int) -> Optional[int]:
    """Bytes of the files in ``writer``'s store (None when it is missing), refusing ``data/``, the
    store or anything in it that is a symbolic link (FormatError naming it). None for an ``s3://``
    checkpoint: an object store has no links, and its sizes are not listed."""
    if is_s3_url(checkpoint_dir):
        return None
    what = f"checkpoint {checkpoint_dir}: store of rank {writer}"
    try:
        refuse_link(os.path.join(checkpoint_dir, DATA_DIR), f"checkpoint {checkpoint_dir}: data directory")
        return scan_tree(rank_dir(checkpoint_dir, writer), what).nbytes
    except FileNotFoundError:
        return None
    except OSError as e:
        raise CheckpointingError(f"{what} cannot be listed: {e}") from e


def check_writer_store(checkpoint_dir: str, writer: int, claimed_bytes: int) -> None:
    """Before reading ``writer``'s store: no links (see :func:`store_bytes`), and no more tensor
    bytes claimed by the index than its files hold (a claim that would size buffers by damaged
    metadata). A missing store is left to the read, which names what is missing."""
    stored = store_bytes(checkpoint_dir, writer)
    if stored is not None and stored < claimed_bytes:
        raise FormatError(f"checkpoint {checkpoint_dir}: store of rank {writer}: metadata.json claims "
                          f"{claimed_bytes} bytes of tensor data in it, but its files hold only {stored} bytes "
                          f"(damaged metadata or lost data)")


def check_stored_sizes(checkpoint_dir: str, index: "CheckpointIndex") -> None:
    """:func:`check_writer_store` for every writer of ``index``: call before allocating whole
    tensors from the shapes the index claims."""
    for writer, claimed in sorted(index.bytes_per_writer().items()):
        check_writer_store(checkpoint_dir, writer, claimed)
