"""Reading a checkpoint's files so that what is read can be trusted: the common state checked
against the SHA-256 its commit marker records, whatever store holds it; in a local directory,
nothing inside it followed through a link and no more bytes claimed by the index than its files
hold (:func:`check_writer_store`, asked by :class:`~.local_store.LocalStore`).
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any, Callable, Dict, Optional, Sequence, Tuple

from ..core.errors import CheckpointingError, FormatError
from .checksums import check_sha256
from .layout import COMMIT_MARKER, COMMON_FILE, DATA_DIR, rank_dir
from .paths import CHUNK_FILE_SLACK, PICKLE_CAP, STORE_INDEX_CAP, SizeCap, refuse_link, scan_tree
from .safe_pickle import loads

if TYPE_CHECKING:
    from ..planning.metadata import CheckpointIndex
    from .store import CheckpointStore


def read_common(store: "CheckpointStore", checkpoint_dir: str, marker: Dict[str, Any],
                extra_safe_globals: Sequence[Any] = ()) -> Any:
    """The common state (``common.pt``) of the committed checkpoint at ``checkpoint_dir`` of
    ``store``, whose commit marker is ``marker``, deserialized safely."""
    where = f"checkpoint {checkpoint_dir}: {COMMON_FILE}"
    return loads(read_common_bytes(store, checkpoint_dir, marker), where, extra_safe_globals)


def read_common_bytes(store: "CheckpointStore", checkpoint_dir: str, marker: Dict[str, Any]) -> bytes:
    """The bytes of ``common.pt`` (a regular file of the checkpoint, or the store's object),
    checked against the SHA-256 its commit marker records (a copy made from them is then no copy
    of damage; skipped when ``store.options.verify`` is off)."""
    where = f"checkpoint {checkpoint_dir}: {COMMON_FILE}"
    from .store import asked  # (store.py is imported for type checking only here)

    blob = asked(store, f"read_blob({checkpoint_dir!r}, {COMMON_FILE!r})", store.read_blob, checkpoint_dir,
                 COMMON_FILE)
    if blob is None:
        raise CheckpointingError(f"{where} is missing")
    if not blob:
        raise FormatError(f"{where} is empty (0 bytes)")
    if "common_sha256" in marker:
        try:
            check_sha256(blob, marker["common_sha256"], where, store.options.verify)
        except FormatError:
            _check_same_commit(store, checkpoint_dir, marker)
            raise
    return blob


def _check_same_commit(store: "CheckpointStore", checkpoint_dir: str, marker: Dict[str, Any]) -> None:
    """After a checksum mismatch: CheckpointingError (not damage) when the commit marker now at
    ``checkpoint_dir`` is not the one the load opened, a save having committed to the same path since
    (another job, a second writer): what was read is that save's, and the checkpoint is not damaged. (An
    object store keeps its marker beside the versions it names: it says so itself, ``S3Store.read_blob``.)"""
    if not store.file_system:
        return
    try:
        raw = store.read_blob(checkpoint_dir, COMMIT_MARKER)
        now = None if raw is None else json.loads(raw)
    except (OSError, ValueError, CheckpointingError):
        return  # no evidence either way: the mismatch stands
    if now != marker:
        raise CheckpointingError(f"checkpoint {checkpoint_dir} was replaced while being read (a save committed to the "
                                 f"same path since it was opened: another job, or another writer); load it again")


def store_bytes(checkpoint_dir: str, writer: int, claimed_bytes: Optional[int] = None) -> Optional[int]:
    """Bytes of the files in ``writer``'s store (None when it is missing), refusing ``data/``, the
    store or anything in it that is a symbolic link (FormatError naming it). Given the tensor bytes
    the index claims for it, also every file too large for what tensorstore reads whole
    (:func:`_file_size_check`)."""
    what = f"checkpoint {checkpoint_dir}: store of rank {writer}"
    store = rank_dir(checkpoint_dir, writer)
    check = None if claimed_bytes is None else _file_size_check(store, what, claimed_bytes)
    try:
        refuse_link(os.path.join(checkpoint_dir, DATA_DIR), f"checkpoint {checkpoint_dir}: data directory")
        return scan_tree(store, what, check).nbytes
    except FileNotFoundError:
        return None
    except OSError as e:
        raise CheckpointingError(f"{what} cannot be listed: {e}") from e


def _file_size_check(store: str, what: str, claimed_bytes: int) -> Callable[[str, int], None]:
    """The check :func:`scan_tree` makes of each file of a store whose tensors the index sizes at
    ``claimed_bytes``: tensorstore reads an OCDBT manifest, a zarr.json, a chunk file and an object
    file whole (a sparse file of 100 GB would take every byte of memory), OCDBT data files only in
    the ranges its index names. No chunk holds more than the store's tensors (plus slack for an
    edge chunk stored whole), and objects are pickled state."""
    def check(path: str, size: int) -> None:
        capped = store_file_cap(os.path.relpath(path, store).replace(os.sep, "/"), claimed_bytes)
        if capped is not None:
            capped[0].check(size, path, what + capped[1])
    return check


def store_file_cap(rel: str, claimed_bytes: int) -> Optional[Tuple[SizeCap, str]]:
    """The cap on the file (or object) ``rel`` of a writer's store whose tensors the index sizes at
    ``claimed_bytes``, with what a refusal adds to the store's description; None for what is read only in
    ranges (OCDBT data files) or not at all."""
    if rel == "manifest.ocdbt" or rel.endswith("/zarr.json") or rel == "zarr.json":
        return STORE_INDEX_CAP, ": file"
    if rel.startswith(("t/", "p/")):
        return (SizeCap("chunk file", claimed_bytes + CHUNK_FILE_SLACK),
                f" (whose tensors metadata.json sizes at {claimed_bytes} bytes): file")
    if rel.startswith("o/"):
        return PICKLE_CAP, ": object file"
    return None


def check_writer_store(checkpoint_dir: str, writer: int, claimed_bytes: int) -> None:
    """Before reading ``writer``'s store: no links (see :func:`store_bytes`), no file larger than a
    reader may read whole, and no more tensor bytes claimed by the index than its files hold (a
    claim that would size buffers by damaged metadata). A missing store is left to the read, which
    names what is missing."""
    stored = store_bytes(checkpoint_dir, writer, claimed_bytes)
    if stored is not None and stored < claimed_bytes:
        raise FormatError(f"checkpoint {checkpoint_dir}: store of rank {writer}: metadata.json claims "
                          f"{claimed_bytes} bytes of tensor data in it, but its files hold only {stored} bytes "
                          f"(damaged metadata or lost data)")


def check_stored_sizes(checkpoint_dir: str, index: "CheckpointIndex") -> None:
    """:func:`check_writer_store` for every writer of ``index``: call before allocating whole
    tensors from the shapes the index claims."""
    for writer, claimed in sorted(index.bytes_per_writer().items()):
        check_writer_store(checkpoint_dir, writer, claimed)
