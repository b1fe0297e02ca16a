"""Which rank stores a rank's load reads, so a node fetches only those it lacks (not the whole checkpoint).

Planned as the load plans, from the same pieces: the template converted as ``lightning_distckpt.load``
converts it (Megatron-Core leaves, DTensors, plain tensors), its request, and each requested tensor's
read plan against the index; each requested object's element; every stored plain tensor (restored whole
where the template has no leaf for it). Valid for a load whose every rank reads its own pieces (the
``"every_rank"`` loader); an exchange loader may have any rank read any chunk, so then the node needs all.
"""

from __future__ import annotations

import logging
from typing import Any, Dict, FrozenSet, Optional

from lightning_distckpt.core.megatron_leaves import from_megatron_leaves
from lightning_distckpt.core.plain_tensors import shard_tensors
from lightning_distckpt.planning.load_plan import plan_tensor_read
from lightning_distckpt.planning.metadata import CheckpointIndex
from lightning_distckpt.reading.request import make_request

logger = logging.getLogger(__name__)

PLAIN_FIELD = "plain_tensors"  # metadata.json: the plain tensors a save stored by tree path


def needed_writers(sharded_state_dict: Dict[str, Any], meta: Dict[str, Any], path: str,
                   rank: int) -> Optional[FrozenSet[int]]:
    """The writer ranks whose stores this rank's ``"every_rank"`` load of ``sharded_state_dict`` reads from
    the checkpoint whose ``metadata.json`` is ``meta``; None when it cannot tell (the load will say why:
    then every store is fetched, and the load reports the template's error as any load would)."""
    try:
        index = CheckpointIndex.from_json(meta, f"local checkpoint {path}: metadata.json")
        request = make_request(shard_tensors(from_megatron_leaves(sharded_state_dict), rank))
        out = set()
        for st in request.tensors:
            entry = index.tensors.get(st.key)
            if entry is not None:  # a key the checkpoint lacks is the load's to report
                out.update(item.writer for item in plan_tensor_read(st, entry, path).items)
        for so in request.objects:
            entry = index.objects.get(so.key)
            out.update(s.writer for s in (entry.shards if entry else ()) if tuple(s.offset) == tuple(so.global_offset))
        for key in meta.get(PLAIN_FIELD) or {}:
            entry = index.tensors.get(key)
            out.update(s.writer for s in (entry.shards if entry else ()))
        return frozenset(out)
    except Exception as e:  # noqa: BLE001 - any doubt: fetch everything, the load itself reports errors
        logger.debug("local tier: rank %d cannot tell which stores its load reads (%s): fetching all", rank, e)
        return None
