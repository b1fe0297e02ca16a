"""Before a reader allocates whole tensors of the global shapes an index claims
(``load_plain_tensors``, the exports): the claims must be backed by stored bytes.

A metadata file is a few bytes; the shapes it names are not. A global shape of 1e11 x 1024 over one
small shard, or a store that lost its files, would otherwise size a buffer by the claim. Each
source checks what its own format can (safetensors headers against the file's size, torch views
against their storages, DCP items against their files, our stores against the index); here the
tensors to allocate are checked to be covered by their stored shards
(:mod:`~lightning_distckpt.planning.coverage`), and in our checkpoints every writer the index
names to have a store that holds what the index claims.
"""

from __future__ import annotations

import os
from typing import Any, Iterable, Optional

from ..core.errors import FormatError
from ..planning.coverage import describe_rows, uncovered_rows
from ..storage.integrity import check_stored_sizes
from ..storage.layout import DATA_DIR
from .checkpoint import OpenedCheckpoint


def check_plain_loadable(source: Any, keys: Optional[Iterable[str]] = None) -> None:
    """Raise FormatError unless the tensors ``keys`` of ``source`` (default: all) can be read whole
    from what is stored: their shards cover their global shapes (else the message names the rows
    not stored: such a tensor loads only into a template, with ``ldc.load``), and, in our own
    checkpoints, every writer the index names has its store (counted before any is scanned) holding
    at least the bytes claimed."""
    tensors = source.index.tensors
    for key in tensors if keys is None else keys:
        entry = tensors[key]
        gaps = uncovered_rows(entry)
        if gaps:
            raise FormatError(
                f"{source.path}: tensor {key!r} of global shape {list(entry.global_shape)}: {describe_rows(gaps)} are "
                "not stored (its shards do not cover it); it cannot be read whole without a template "
                "(ldc.load into a sharded template reads the stored part)")
    if isinstance(source, OpenedCheckpoint):
        writers = sum(1 for n in source.index.bytes_per_writer().values() if n)
        stores = _store_count(source.path)
        if stores is not None and writers > stores:
            raise FormatError(f"checkpoint {source.path}: metadata.json names {writers} writer ranks holding "
                              f"tensor data, but data/ holds {stores} rank stores (damaged metadata or lost data)")
        check_stored_sizes(source.path, source.index)


def _store_count(path: str) -> Optional[int]:
    """How many entries ``data/`` of the local checkpoint at ``path`` has (None: not local, or none)."""
    try:
        return len(os.listdir(os.path.join(path, DATA_DIR)))
    except (OSError, ValueError):
        return None
