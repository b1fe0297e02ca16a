"""A rank store's commit that an object store carried out but answered as failed.

A server may store a PUT and still answer it with an error (S3 answers 500 or 503 so now and then).
For an OCDBT manifest, tensorstore's retry then finds a manifest it did not expect, takes it for
another writer's commit, and applies the transaction again on top of it: the arrays' creations
(``zarr.json`` written only if absent) fail ``ALREADY_EXISTS`` against the first attempt. In the
zarr layout an array's ``zarr.json`` PUT is retried itself and fails so. The commit is then over
(one more round, never a loop, however often the server answers so). Whether the first attempt
landed whole is checked here by reading back every array and object of the transaction from the
store's prefix (this save's alone): what reads back equal, through the checksums it was written
with (the arrays' ``crc32c`` codec, the objects' frames), is the transaction's. Anything else
keeps the commit's error."""

from __future__ import annotations

from typing import Any, Dict, Sequence, Tuple

import numpy as np
import tensorstore as ts

#: ``(the spec it was created with, the values written)`` for each array the transaction created.
Arrays = Sequence[Tuple[Dict[str, Any], np.ndarray]]
#: ``(key in the store, the bytes written)`` for each object the transaction wrote.
Objects = Sequence[Tuple[str, bytes]]


def retried_over_itself(error: BaseException, files: bool) -> bool:
    """Whether a failed commit may be a landed one retried over itself: ALREADY_EXISTS from a store on an
    object store (a file system's commit renames its files: they landed or failed). An OCDBT store's
    transaction applied again over its own manifest, or, in the zarr layout, an array's ``zarr.json``
    (written only if absent) PUT again after it landed: the store's prefix is this save's alone, and what
    is there is taken only if it all reads back as written (:func:`landed_whole`)."""
    return not files and str(error).startswith("ALREADY_EXISTS")


def landed_whole(kvstore: Dict[str, Any], context: Any, arrays: Arrays, objects: Objects) -> bool:
    """Whether the store at ``kvstore`` now holds every array and object of the transaction, bit-exact.

    Read outside the transaction, one array at a time (on this rare path a store costs its bytes
    read once more, and at most its largest array in memory again), each opened with the spec it was
    created with (its metadata constraints checked). Any read failure or difference is a no."""
    try:
        for spec, written in arrays:
            stored = ts.open(spec, open=True, context=context).result().read().result()
            if stored.shape != written.shape or np.ascontiguousarray(stored).tobytes() != \
                    np.ascontiguousarray(written).tobytes():
                return False
        if objects:
            kv = ts.KvStore.open(kvstore, context=context).result()
            for key, framed in objects:
                got = kv.read(key).result()
                if got.state != "value" or bytes(got.value) != framed:
                    return False
    except Exception:  # unreadable: not shown to have landed; the commit's own error is reported
        return False
    return True
