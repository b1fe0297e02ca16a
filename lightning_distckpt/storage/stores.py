"""Which store holds a checkpoint: the one place that picks a :class:`ShardWriter` for a location.

Every location is written by :class:`~lightning_distckpt.storage.tensorstore_io.TensorStoreIO`:
a local (or mounted) directory through tensorstore's ``file`` kvstore, an ``s3://`` version
location (:mod:`.s3`) through its ``s3`` kvstore. Another store plugs in here by returning its own
writer for its locations, without the save path changing.
"""

from __future__ import annotations

from .base import ShardWriter
from .tensorstore_io import StorageOptions, TensorStoreIO


def open_writer(root: str, options: StorageOptions) -> ShardWriter:
    """The writer of the stored shards and objects under ``root`` (a save's staging location),
    laid out as ``options`` say. Opening touches nothing: the writer creates what it writes."""
    return TensorStoreIO(root, options)
