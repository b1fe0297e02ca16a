"""The bytes of the ShardedObjects a rank may write, serialized before the save's handshake.

A save writes each object element from the lowest rank holding its main replica (``planning/save_plan``).
Serialized only once the plan said so, an object that cannot be pickled on one rank (a lambda, a lock, an
open file in it) raised on that rank alone, after every collective of the preparation: its peers went on
to write and waited for it in the commit's agreement until the group's timeout, leaving a staging
directory. Serialized while the rank describes its state (``save_prepare._describe``), the failure is
agreed in the handshake, before anything is written, and raised on every rank.
"""

from __future__ import annotations

import logging
from typing import Dict, List

from ..core.errors import CheckpointingError
from ..core.mapping import ShardedObject
from ..storage.paths import PICKLE_CAP
from ..storage.safe_pickle import dumps

logger = logging.getLogger(__name__)


def pickle_objects(objects: List[ShardedObject], target: str) -> Dict[int, bytes]:
    """Position in ``objects`` -> the pickled value of each main replica (the only ones a plan writes).

    A value that cannot be pickled is a CheckpointingError naming the object's key and element. One
    larger than a load reads (``PICKLE_CAP``) is said now, in a WARNING, as for the common state: a
    load refuses it unless the cap is raised."""
    out: Dict[int, bytes] = {}
    for i, so in enumerate(objects):
        if not so.is_main_replica:
            continue
        try:
            out[i] = dumps(so.data)
        except Exception as e:  # whatever pickling raises: a lambda, a lock, a socket, no memory
            raise CheckpointingError(f"checkpoint {target}: ShardedObject {so.key!r} element {so.global_offset} "
                                     f"cannot be serialized: {type(e).__name__}: {e}") from e
        if len(out[i]) > PICKLE_CAP.limit():
            logger.warning("save to %s: ShardedObject %r element %s pickles to %d bytes, more than the %d a load "
                           "reads unless %s is raised", target, so.key, so.global_offset, len(out[i]),
                           PICKLE_CAP.limit(), PICKLE_CAP.env)
    return out
