"""Export to a Megatron-Core ``torch_dist`` checkpoint that ``megatron.core.dist_checkpointing.load``
reads under any split.

``torch_dist`` is a PyTorch DCP checkpoint plus two files of Megatron's, so this is the DCP export
(:func:`~lightning_distckpt.export.dcp_out.write_dcp_dir`: one process, about one tensor in memory at
a time, the directory swapped in when complete) with other entries:

* every tensor under its stored key (a Lightning Trainer checkpoint's module weights under the
  LightningModule's keys), which is the ``ShardedTensor.key`` Megatron-Core loads it by;
* every ShardedObject element as a DCP bytes entry named by Megatron's unique key
  ``<key>/shard_<offset>_<global shape>``, holding ``torch.save([value])`` as Megatron writes it;
* ``common.pt``: the common state (a dict; anything else is stored as ``{"common": value}``);
* ``metadata.json``: ``{"sharded_backend": "torch_dist", ...}`` (Megatron's ``CheckpointingConfig``).

megatron-core is not needed to write it.
"""

from __future__ import annotations

import json
import time
from typing import Any, Dict, Mapping, Optional, Sequence

from ..convert import ConvertReport, directory_bytes
from ..reading.checkpoint import CheckpointSource
from ..reading.formats import KeyMap
from ..reading.formats.megatron import COMMON_NAME, CONFIG_NAME, TORCH_DIST, unique_key
from ..storage.safe_pickle import dumps, loads
from ..progress import Progress
from .dcp_out import write_dcp_dir
from .select import selection
from .tensors import LIGHTNING_MANIFEST_KEY, add_meta_placeholders, export_arguments, export_tensors, open_source

MEGATRON_CONFIG = {"sharded_backend": TORCH_DIST, "sharded_backend_version": 1,
                   "common_backend": "torch", "common_backend_version": 1}


def _objects(source: CheckpointSource, extra_safe_globals: Sequence[Any]) -> Dict[str, Any]:
    """unique key -> ``[value]`` for every stored ShardedObject element (DCP pickles the list)."""
    out: Dict[str, Any] = {}
    reader = source.reader()
    for key, entry in source.index.objects.items():
        for s in entry.shards:
            blob = reader.read_object(s.writer, key, s.index)
            value = loads(blob, f"checkpoint {source.path}: object {key!r} at {list(s.offset)}", extra_safe_globals)
            out[unique_key(key, s.offset, entry.global_shape)] = [value]
    return out


def _common(source: CheckpointSource, extra_safe_globals: Sequence[Any]) -> Dict[str, Any]:
    common = source.load_common(extra_safe_globals)
    if isinstance(common, Mapping):
        return {k: v for k, v in common.items() if k != LIGHTNING_MANIFEST_KEY}
    return {} if common is None else {"common": common}


def to_megatron(checkpoint: Any, out_dir: Any, key_map: KeyMap = None,
                extra_safe_globals: Sequence[Any] = (), *, only: Optional[str] = None,
                include: Sequence[str] = (), progress: Optional[Progress] = None) -> ConvertReport:
    """Write ``checkpoint`` (anything ``ldc.load`` reads) as the Megatron-Core ``torch_dist``
    directory ``out_dir``.

    Single process (call it on one rank). ``key_map`` renames (dict) or leaves out (callable
    returning None) tensors by their export name; ``only`` / ``include`` select tensors as
    :func:`~lightning_distckpt.export.to_dcp` does. ``progress`` counts the bytes
    exported. ``extra_safe_globals``: further trusted types its objects and common state may hold.
    Returns a :class:`ConvertReport` (kind ``"megatron"``).

    Raises:
        ArgumentError, ArgumentTypeError: an argument that is wrong (naming it), an output over the input.
        CheckpointNotFoundError, IncompleteCheckpointError: nothing, or no committed checkpoint, at the source.
        FormatError: the source fails its checks (UnsafeContentError: a type not allowed to deserialize).
        CheckpointingError: writing failed (naming the file); ``out_dir`` is left as it was.
    """
    t0 = time.perf_counter()
    out = export_arguments(out_dir, key_map, extra_safe_globals)
    select = selection(only, include)
    source = open_source(checkpoint, out)
    tensors = export_tensors(source, key_map, extra_safe_globals, module_prefix="", select=select)
    state: Dict[str, Any] = _objects(source, extra_safe_globals)
    by_id = add_meta_placeholders(source, tensors, state, "a ShardedObject")
    extra = {COMMON_NAME: dumps(_common(source, extra_safe_globals)),
             CONFIG_NAME: json.dumps(MEGATRON_CONFIG).encode()}  # metadata.json last: Megatron's completeness mark
    # an object's list is one bytes entry
    write_dcp_dir(source, state, by_id, out, extra, flatten=False, progress=progress)
    n_objects = sum(len(e.shards) for e in source.index.objects.values())
    return ConvertReport(source.path, out, "megatron", len(tensors), n_objects, directory_bytes(out),
                         time.perf_counter() - t0)
