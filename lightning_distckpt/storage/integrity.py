"""Opening a checkpoint's files so that what is read can be trusted: the directory is resolved
once to its real path (a missing one is described with where a good checkpoint is), nothing inside
it is followed through a link, and the common state is read as a regular file of the checkpoint.
"""

from __future__ import annotations

import os
from typing import Any, Dict, Sequence

from ..core.errors import CheckpointingError, FormatError, IncompleteCheckpointError
from .layout import COMMON_FILE, MetadataFile, open_metadata
from .paths import PathLike, local_path, read_inside
from .safe_pickle import loads
from .staging import describe_missing


def open_checkpoint_metadata(checkpoint_dir: PathLike) -> MetadataFile:
    """The checked metadata of the committed checkpoint at ``checkpoint_dir`` (see
    :func:`~lightning_distckpt.storage.layout.open_metadata`); a missing directory (or a dangling
    ``last.ckpt`` link) says where the newest committed checkpoints are."""
    given = os.path.abspath(local_path(checkpoint_dir))
    if not os.path.isdir(given):
        raise IncompleteCheckpointError(f"checkpoint {given}: {describe_missing(given)}")
    return open_metadata(given)


def read_common(checkpoint_dir: str, marker: Dict[str, Any], extra_safe_globals: Sequence[Any] = ()) -> Any:
    """The common state (``common.pt``) of the checkpoint at the real path ``checkpoint_dir``,
    whose commit marker is ``marker``, deserialized safely."""
    path = os.path.join(checkpoint_dir, COMMON_FILE)
    where = f"checkpoint {checkpoint_dir}: {COMMON_FILE}"
    try:
        blob = read_inside(path, f"checkpoint {checkpoint_dir}:")
    except FileNotFoundError:
        raise CheckpointingError(f"{where} is missing") from None
    except OSError as e:
        raise CheckpointingError(f"{where} cannot be read: {e.strerror or e}") from None
    if not blob:
        raise FormatError(f"{where} is empty (0 bytes)")
    return loads(blob, where, extra_safe_globals)
