"""The marker of the tiers in a TierCheckpoint's folder (``tiers-last.json``): reading, touching, removing it."""

from __future__ import annotations

import json
import logging
import os
import posixpath
from typing import Any, Optional

from ..core.errors import CheckpointingError
from .slurm_requeue import is_requeue_save

log = logging.getLogger("lightning_distckpt.lightning.tiers")

#: The file in the TierCheckpoint's folder that says local saves were made here.
MARKER_NAME = "tiers-last.json"


def is_s3(path: str) -> bool:
    return path.startswith("s3://")


def _marker_folder(marker: str) -> Any:
    """The object store of the ``s3://`` folder holding ``marker``."""
    from ..storage.s3 import ObjectStore
    from ..storage.options import StorageOptions

    return ObjectStore(marker[:-len(MARKER_NAME)].rstrip("/"), StorageOptions())


def _run_of(marker_data: bytes) -> Optional[str]:
    """The run a marker names; None for one written before runs were recorded, or not a marker of ours."""
    try:
        run = json.loads(marker_data).get("run")
    except (ValueError, AttributeError):  # written by hand, or damaged
        return None
    return run if isinstance(run, str) else None


def _read_marker(marker: str) -> Optional[bytes]:
    """The marker's bytes (at most 64 KiB: it is ~200), None where there is none (a link is none of ours);
    one that cannot be read is an error, not none (a new run would never resume the marker's run's steps)."""
    try:
        if is_s3(marker):
            return _marker_folder(marker).read(MARKER_NAME)
        if os.path.islink(marker) or not os.path.isfile(marker):
            return None
        with open(marker, "rb") as f:
            return f.read(1 << 16)
    except (OSError, CheckpointingError) as e:
        raise CheckpointingError(f"reading the marker {marker} failed ({e}): the run whose local steps "
                                 "this Trainer continues is unknown") from None


def _touch_marker(marker: str) -> bool:
    """Whether the marker exists; if so its modification time is made now (the newest ``last`` candidate).
    Every rank alone, before any process group exists: the S3 object written again with its own bytes
    (identical concurrent writes are harmless), fsspec's cached listing dropped (``modified`` asks S3 again)."""
    if not is_s3(marker):
        if os.path.islink(marker) or not os.path.isfile(marker):  # a link's target is not ours to touch
            return False
        os.utime(marker, follow_symlinks=False)
        return True
    folder = _marker_folder(marker)
    data = folder.read(MARKER_NAME)
    if data is None:
        return False
    folder.write(MARKER_NAME, data)
    try:
        from lightning.fabric.utilities.cloud_io import get_filesystem

        get_filesystem(marker).invalidate_cache()
    except Exception as e:  # noqa: BLE001 - without s3fs Lightning cannot resolve "last" on S3 at all
        log.debug("tiers: dropping fsspec's cache for %s failed: %s", marker, e)
    return True


def resumes_run(ckpt_path: Any, marker: str) -> bool:
    """Whether a fit from ``ckpt_path`` (as Lightning resolved it) continues the run ``marker`` names: the marker
    itself however it was spelled (relative, through a linked folder, a ``Path``), or the checkpoint Lightning's
    SLURM auto-requeue saved and resumes from (``hpc_ckpt_<N>.ckpt``: the same job, requeued)."""
    if ckpt_path is None:
        return False
    path = os.fspath(ckpt_path) if isinstance(ckpt_path, os.PathLike) else str(ckpt_path)
    if is_requeue_save(path):
        return True
    if os.path.basename(path) != MARKER_NAME:
        return False
    if is_s3(path) or is_s3(marker):  # no links in a bucket; "//" and "/./" are spelling
        return is_s3(path) and is_s3(marker) and posixpath.normpath(path[5:]) == posixpath.normpath(marker[5:])
    return os.path.realpath(path) == os.path.realpath(marker)


def remove_marker(marker: str, run: Optional[str]) -> bool:
    """Rank 0: the marker removed if it still names ``run`` (one naming another run is another job's, kept);
    whether it was."""
    data = _read_marker(marker)
    if data is None or _run_of(data) != run:
        return False
    if is_s3(marker):
        _marker_folder(marker).delete(MARKER_NAME)
    else:
        os.remove(marker)
    return True
