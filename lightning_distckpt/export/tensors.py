"""What an export writes: the stored tensors of a checkpoint under their output names, and whole
tensors read from it in batches.

Any source :func:`~lightning_distckpt.reading.checkpoint.open_checkpoint` opens can be exported
(our directories, DCP directories, tensor files, Hugging Face directories). A Lightning Trainer
checkpoint (one whose common state carries the tree manifest that ``DistCheckpointIO`` and the
strategies write) exports only its module weights, named by the LightningModule's ``state_dict``
keys: the tensors the manifest places under ``"state_dict"``. Every other checkpoint exports every
tensor under its stored key. ``key_map`` then renames (a dict; keys it lacks keep their name) or
leaves out (a callable returning None).
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Set, Tuple

import torch

from ..core.arguments import require_globals, require_key_map
from ..core.errors import CheckpointingError, FormatError
from ..core.mapping import ShardedTensor
from ..reading.checkpoint import CheckpointSource, OpenedCheckpoint, open_checkpoint
from ..reading.formats import KeyMap
from ..reading.formats.tensor_files import map_key
from ..reading.plain import check_plain_loadable
from ..reading.reads import read_tensors
from ..storage.base import ShardReader
from ..storage.outputs import Replaced, check_output
from ..storage.paths import local_path
from .select import Selection, optimizer_state_keys

logger = logging.getLogger(__name__)

# The key of the tree manifest in a Lightning checkpoint's common state
# (lightning_distckpt.lightning.tree.MANIFEST_KEY; not imported: that package imports Lightning).
LIGHTNING_MANIFEST_KEY = "__distckpt__"
MODULE_ENTRY = "state_dict"  # where a Trainer checkpoint keeps the LightningModule's weights


@dataclass(frozen=True)
class ExportTensor:
    """One tensor to write: its output ``name``, the stored ``key`` it is read from, shape and dtype."""

    name: str
    key: str
    shape: Tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def export_arguments(out_dir: Any, key_map: Any, extra_safe_globals: Any) -> str:
    """The absolute path of the output directory ``out_dir``, after checking the arguments every
    export takes (ArgumentTypeError / ArgumentError naming the one that is wrong)."""
    require_key_map(key_map)
    require_globals(extra_safe_globals)
    return os.path.abspath(local_path(out_dir, "out_dir"))


def open_source(checkpoint: Any, destination: str, replaced: Replaced = None) -> CheckpointSource:
    """The checkpoint to export, opened. A missing path is a CheckpointingError naming it; a
    ``destination`` that is or lies inside it, or a destination that holds it and replaces it
    (``replaced``: which of its entries the export replaces, None for all) an ArgumentError
    (:func:`~lightning_distckpt.storage.outputs.check_output`), raised before anything is written."""
    path = local_path(checkpoint, "checkpoint")
    if not os.path.exists(path):
        raise CheckpointingError(f"{path}: no such checkpoint file or directory")
    check_output(destination, [("checkpoint", path)], "export destination", replaced)
    return open_checkpoint(path)


def _manifest_paths(source: CheckpointSource, common: Any) -> Dict[str, List[Any]]:
    """Stored key -> the steps (dict keys, list indices) of its place in the saved tree, from a
    Lightning checkpoint's manifest; empty for any other checkpoint."""
    if not isinstance(source, OpenedCheckpoint):
        return {}
    manifest = common.get(LIGHTNING_MANIFEST_KEY) if isinstance(common, Mapping) else None
    if not isinstance(manifest, Mapping):
        return {}
    try:
        return {key: [k for _, k in steps] for steps, key in manifest.get("tensor_paths", [])
                if all(len(s) == 2 for s in steps)}
    except (TypeError, ValueError) as e:
        raise FormatError(f"checkpoint {source.path}: malformed {LIGHTNING_MANIFEST_KEY} manifest ({e})") from None


def module_weight_names(source: CheckpointSource, extra_safe_globals: Sequence[Any] = (),
                        common: Any = None) -> Optional[Dict[str, str]]:
    """For a Lightning Trainer checkpoint: stored key -> the LightningModule's ``state_dict`` key of
    each module weight. None for any other checkpoint. ``common``: its common state, if read already."""
    if not isinstance(source, OpenedCheckpoint):
        return None
    common = source.load_common(extra_safe_globals) if common is None else common
    names = {key: ".".join(str(k) for k in steps[1:]) for key, steps in _manifest_paths(source, common).items()
             if len(steps) >= 2 and steps[0] == MODULE_ENTRY}
    return names or None


def export_tensors(source: CheckpointSource, key_map: KeyMap = None, extra_safe_globals: Sequence[Any] = (),
                   module_prefix: Optional[str] = None, select: Selection = Selection()) -> List[ExportTensor]:
    """The tensors an export of ``source`` writes, sorted by output name. With ``module_prefix``
    (a full export), a Lightning checkpoint's other tensors are written too, under their stored
    keys, and its module weights are named ``module_prefix + <module key>``. ``select``
    (:mod:`.select`) leaves out optimizer state (``only="model"``: of a Trainer checkpoint, all but
    the module weights) or tensors whose stored key and names match no ``include`` prefix."""
    common = source.load_common(extra_safe_globals) if isinstance(source, OpenedCheckpoint) or select.only else None
    module_names = module_weight_names(source, extra_safe_globals, common)
    optimizer: Set[str] = set()
    if select.only == "model":
        optimizer = optimizer_state_keys(source.index.tensors, common, _manifest_paths(source, common))
    out: Dict[str, ExportTensor] = {}
    for key, entry in source.index.tensors.items():
        default = key if module_names is None else module_names.get(key)
        if module_names is not None and module_prefix is not None:
            in_module = default is not None
            default = key if default is None else module_prefix + default
            if select.only == "model" and not in_module:  # the Trainer's optimizer, loops' and callbacks' tensors
                continue
        names = [key] + ([default] if default is not None else []) + ([module_names[key]] if module_names and
                                                                      key in module_names else [])
        if default is not None and not select.keeps(names, key in optimizer):
            continue
        name = None if default is None else map_key(key_map, default)
        if name is None:
            continue
        if name in out:
            raise FormatError(f"checkpoint {source.path}: tensors {out[name].key!r} and {key!r} would both be "
                              f"exported as {name!r}; fix key_map")
        out[name] = ExportTensor(name, key, tuple(entry.global_shape), entry.torch_dtype)
    if module_names is not None and module_prefix is None:
        logger.info("%s: Lightning checkpoint; exporting its %d module weight(s) of %d stored tensor(s)",
                    source.path, len(module_names), len(source.index.tensors))
    check_plain_loadable(source, [t.key for t in out.values()])  # each is read whole: its claim backed by bytes
    return sorted(out.values(), key=lambda t: t.name)


def whole_request(t: ExportTensor) -> ShardedTensor:
    """A request for the whole stored tensor of ``t`` (read into a fresh buffer)."""
    return ShardedTensor(key=t.key, data=None, dtype=t.dtype, local_shape=t.shape, global_shape=t.shape,
                         global_offset=(0,) * len(t.shape))


def read_whole(source: CheckpointSource, tensors: Sequence[ExportTensor],
               reader: ShardReader) -> Dict[str, torch.Tensor]:
    """Output name -> the whole tensor, for each of ``tensors`` (one concurrent read)."""
    loaded, _ = read_tensors(source, [whole_request(t) for t in tensors], set(), reader)
    out: Dict[str, torch.Tensor] = {}
    for t, data in zip(tensors, loaded):
        assert data is not None  # nothing skipped
        out[t.name] = data
    return out


def add_meta_placeholders(source: CheckpointSource, tensors: Sequence[ExportTensor], state: Dict[str, Any],
                          other: str) -> Dict[int, ExportTensor]:
    """Put a ``meta`` tensor of each of ``tensors`` into ``state`` under its export name (the writers
    plan from shapes alone and fetch the bytes later); returns ``id(placeholder) -> tensor``.
    A name already in ``state`` (an entry of kind ``other``) is refused."""
    by_id: Dict[int, ExportTensor] = {}
    for t in tensors:
        if t.name in state:
            raise CheckpointingError(f"checkpoint {source.path}: tensor {t.key!r} and {other} are both named "
                                     f"{t.name!r}; rename the tensor with key_map")
        state[t.name] = torch.empty(t.shape, dtype=t.dtype, device="meta")
        by_id[id(state[t.name])] = t
    return by_id
