"""Turning Lightning checkpoint dicts into sharded state dicts and back.

A checkpoint is saved as its natural tree: tensors become ShardedTensors in place, everything else
is common state. Next to it goes a small manifest (``MANIFEST_KEY``) listing where each
ShardedTensor sat (typed path steps), so that a checkpoint can be read back without a template:
each tensor whole, in its place (:func:`template_from_manifest`).

Paths, keys and putting leaves back are :mod:`~lightning_distckpt.core.tree_paths`' (``Step``:
``("d", key)`` into a dict, ``("l", index)`` into a list); this module only chooses what a
Lightning checkpoint's tree is (dicts and lists: a tuple is common state as a whole) and reads the
manifest, which comes from the checkpoint's common state and is checked as such.
"""

from __future__ import annotations

from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch
from torch.distributed.tensor import DTensor, Replicate

from ..core.errors import FormatError, ShardingError
from ..core.mapping import LocalNonpersistentObject, ShardedTensor
from ..core.plain_tensors import storable_key
from ..core.tree_paths import (PICKLED_KEYS, Step, Steps, free_place, key_by_path, path_key, put_at, step_of,
                               steps_from_json)
from ..core.tree_walk import copy_containers, fold, walk_paths
from ..reading.plain_tensors import MAX_LIST_INDEX, MAX_PADDING
from .key_order import ORDERS_KEY, in_saved_order, key_orders, recorded_orders, restore_key_orders

MANIFEST_KEY = "__distckpt__"
MANIFEST_VERSION = 1
KIND_PLAIN = "plain"  # whole tensors saved by one process (stock DDP / single device)
KIND_SHARDED = "sharded"  # ShardedTensors from every rank (DistCheckpointStrategy, Fabric strategy)
# DTensors from every rank (DistCheckpointModelParallelStrategy): keyed by their path in the checkpoint
# dict, optimizer state by parameter name (torch.distributed.checkpoint.state_dict's layout)
KIND_MODEL_PARALLEL = "model_parallel"
TREE_TYPES = (dict, list)  # the containers of a Lightning checkpoint's tree (tuples are common state whole)


def iter_tensor_leaves(tree: Any, where: str = "the checkpoint") -> Iterator[Tuple[Tuple[Step, ...], torch.Tensor]]:
    """Tensors reachable through dicts and lists (other containers are common state as they are),
    at every path (a bounded walk, :mod:`~lightning_distckpt.core.tree_walk`)."""
    for steps, leaf in walk_paths(tree, where=where, types=TREE_TYPES, step=step_of):
        if isinstance(leaf, torch.Tensor):
            yield steps, leaf


def key_of(steps: Steps) -> str:
    """The checkpoint key of the leaf at ``steps`` (:func:`~lightning_distckpt.core.tree_paths.path_key`;
    ``""`` for the top of the tree itself)."""
    return path_key(steps) if steps else ""


def plain_to_sharded(checkpoint: Dict[str, Any]) -> Dict[str, Any]:
    """A copy of the containers of ``checkpoint`` with every tensor (1-d or more) replaced by a whole
    ShardedTensor keyed by its path (``state_dict/layer.weight``, ``optimizer_states/0/state/3/exp_avg``).
    Scalars (0-d tensors) stay common state. A DTensor replicated over its mesh is saved whole; a
    sharded one is refused (:func:`whole_dtensor`)."""

    def convert(steps: Steps, node: Any) -> Any:
        if isinstance(node, DTensor):  # replicated: its local tensor (a 0-d one stays common state)
            node = whole_dtensor(key_of(steps), node)
            if node.ndim == 0:
                return node
        if not (isinstance(node, torch.Tensor) and node.ndim > 0):
            return None
        key = path_key(steps)
        data = node.detach()
        if data.layout != torch.strided:
            raise ShardingError(f"{key!r}: only dense (strided) tensors can be saved, got {data.layout}")
        return ShardedTensor.from_rank_offsets(key, data.contiguous())

    # keyed by path, two leaves with one key refused (dict keys 0 and "0"); a dict under two keys is
    # converted at each; every container copied (the caller adds the manifest to the copy)
    return key_by_path(checkpoint, convert, "the checkpoint", types=TREE_TYPES, build=copy_containers)


def rank_zero_tensors(rest: Dict[str, Any], rank: int) -> Dict[str, Any]:
    """``rest``, the entries of a Lightning checkpoint besides the module's and optimizers' state, as
    rank ``rank`` of a collective save gives them. Their plain tensors (callback scores, ...) would be
    saved as replicated tensors keyed by their paths (:func:`~lightning_distckpt.core.plain_tensors.shard_tensors`),
    written by whichever rank the plan picks; but each rank's Trainer holds its own values there (a metric
    logged without ``sync_dist``: ``ModelCheckpoint.best_k_models`` keyed by file names made of it, its
    scores, ``EarlyStopping.best_score``). Stock Lightning saves rank 0's checkpoint whole, so only rank 0
    gives them: on the other ranks they are left out of the save (a rank-1 key was refused as a gap, a
    rank-1 score was saved beside rank 0's paths)."""
    if rank == 0:
        return rest

    def leave_out(steps: Steps, node: Any) -> Optional[LocalNonpersistentObject]:
        # exactly the leaves shard_tensors would store as tensors; the rest is common state, rank 0's
        return LocalNonpersistentObject(node) if plain_stored(steps, node) else None

    return key_by_path(rest, leave_out, "the checkpoint")


def whole_dtensor(key: str, dt: DTensor) -> torch.Tensor:
    """The whole tensor of a DTensor replicated on every rank of its mesh (its local tensor); one
    process cannot save a sharded one (the other ranks' shards are not here): refuse, never save
    it as common state."""
    if all(isinstance(p, Replicate) for p in dt.placements):
        return dt.to_local()
    raise ShardingError(
        f"{key!r} is a DTensor sharded over a device mesh (placements {tuple(dt.placements)}): "
        "DistCheckpointIO.save_checkpoint saves from one process, which holds only its own shard. Save it "
        "collectively (Trainer: DistCheckpointModelParallelStrategy; DistCheckpointIO.save_sharded or "
        "lightning_distckpt.save on every rank), or gather it first (dt.full_tensor(), or "
        "StateDictOptions(full_state_dict=True) / ModelParallelStrategy(save_distributed_checkpoint=False))"
    )


def manifest(tree: Dict[str, Any], kind: str, ordered_as: Optional[Mapping[str, Any]] = None) -> Dict[str, Any]:
    """Where each ShardedTensor and DTensor of ``tree`` sits (factories' expansions are not listed:
    they can only be put back by their ``merge_fn``), and the key order of the dicts a load would
    reorder (:mod:`.key_order`). ``ordered_as``: the checkpoint dict ``tree`` was built from, whose key
    order ``tree``'s own keys take first (in place: the strategies build their entries out of order)."""
    if ordered_as is not None:
        in_saved_order(tree, ordered_as)
    paths: List[Tuple[List[Step], str]] = []
    for steps, node in walk_paths(tree, where="the checkpoint", types=TREE_TYPES, step=step_of):
        if isinstance(node, ShardedTensor) and node.flattened_range is None:
            paths.append((list(steps), node.key))
        elif isinstance(node, DTensor):  # saved under its tree path (core/dtensors.py): readable whole
            paths.append((list(steps), key_of(steps)))
    out = {"version": MANIFEST_VERSION, "kind": kind, "tensor_paths": paths}
    orders = key_orders(tree, stored_as_tensor)  # after the bounded walk above: no cycle, not too deep
    if orders:
        out[ORDERS_KEY] = orders
    return out


def plain_stored(steps: Sequence[Any], node: Any) -> bool:
    """Whether a save stores the leaf ``node`` at ``steps``, a plain tensor, as a tensor keyed by its path
    (:func:`~lightning_distckpt.core.plain_tensors.shard_tensors` keys it), else as common state."""
    return type(node) in (torch.Tensor, torch.nn.Parameter) and storable_key(tuple(steps), node) is not None


def stored_as_tensor(steps: Sequence[Any], tensor: torch.Tensor) -> bool:
    """Whether a save stores the tensor leaf at ``steps`` as a tensor (a DTensor always), else as common state."""
    return isinstance(tensor, DTensor) or plain_stored(steps, tensor)


def without_manifest(state: Dict[str, Any], where: str) -> Dict[str, Any]:
    """``state``, a checkpoint read whole, with its manifest taken out and its dicts' keys in the order
    the manifest recorded (in place)."""
    restore_key_orders(state, recorded_orders(state.pop(MANIFEST_KEY, None)), where)
    return state


def torch_optimizer_states(tree: Any) -> Any:
    """Wherever a tree read whole holds optimizer state in the strategies' layout (state and param
    groups by parameter key), the same in ``torch.optim``'s layout (by parameter index, in param
    group order), so a stock strategy's ``optimizer.load_state_dict`` takes it (a bounded walk)."""
    return fold(tree, _same, _torch_layout, where="the checkpoint", types=TREE_TYPES)


def _same(leaf: Any) -> Any:
    return leaf


def _torch_layout(node: Any, keys: Optional[List[Any]], results: List[Any]) -> Any:
    """A copy of ``node``; an optimizer state in the strategies' layout is rewritten as it is
    (its own children as they were: they hold no further optimizer state)."""
    if keys is None:
        return results
    if not _keyed_optimizer_state(node):
        return dict(zip(keys, results))
    order = [p for g in node["param_groups"] for p in g.get("params", [])]
    index = {key: i for i, key in enumerate(order)}
    return {**node, "state": {index[k]: v for k, v in node.get("state", {}).items() if k in index},
            "param_groups": [{**g, "params": [index[p] for p in g.get("params", [])]} for g in node["param_groups"]]}


def _keyed_optimizer_state(node: Dict[str, Any]) -> bool:
    groups = node.get("param_groups")
    return (isinstance(groups, list) and bool(groups) and all(isinstance(g, dict) for g in groups)
            and all(isinstance(g.get("params", []), list) for g in groups)  # read from the checkpoint
            and all(isinstance(p, str) for g in groups for p in g.get("params", []))
            and isinstance(node.get("state", {}), dict))


def manifest_paths(man: Any, where: str) -> Dict[str, Steps]:
    """key -> typed steps of each tensor a manifest lists, checked (it is read from the checkpoint's
    common state: FormatError naming ``where`` for an unknown version, a malformed entry or steps
    core's :func:`~lightning_distckpt.core.tree_paths.steps_from_json` refuses)."""
    if not isinstance(man, Mapping) or man.get("version") != MANIFEST_VERSION:
        raise FormatError(f"checkpoint {where}: unknown {MANIFEST_KEY} manifest {man!r:.200}")
    entries = man.get("tensor_paths", [])
    if not isinstance(entries, list):
        raise FormatError(f"checkpoint {where}: {MANIFEST_KEY} tensor_paths must be a list, got {entries!r:.200}")
    out: Dict[str, Steps] = {}
    for entry in entries:
        if not (isinstance(entry, (list, tuple)) and len(entry) == 2 and isinstance(entry[1], str)):
            raise FormatError(f"checkpoint {where}: {MANIFEST_KEY} entry must be [steps, key], got {entry!r:.200}")
        steps = [list(s) if isinstance(s, tuple) else s for s in entry[0]] if isinstance(entry[0], list) else entry[0]
        # the save recorded each leaf's dict keys as they were (bytes, tuple, None...: pickled, not JSON)
        out[entry[1]] = steps_from_json(steps, entry[1], f"checkpoint {where}: {MANIFEST_KEY} tensor_paths",
                                        MAX_LIST_INDEX, joined=False, dict_keys=PICKLED_KEYS)
    return out


def place_at(root: Dict[str, Any], paths: Mapping[str, Steps], leaves: Mapping[str, Any], where: str) -> None:
    """Put each of ``leaves`` (key -> value) at its path under ``root``, creating the dicts and lists
    on the way (:func:`~lightning_distckpt.core.tree_paths.put_at`); a place already taken, or
    needing more than MAX_PADDING empty list slots, is a FormatError naming ``where``."""
    padded = 0
    for key, leaf in leaves.items():
        steps = paths[key]
        depth = free_place(root, steps)
        if depth is None:
            raise FormatError(f"checkpoint {where}: manifest path {[list(s) for s in steps]} of {key!r} does not "
                              "fit its containers (a leaf or another container is there)")
        padded += put_at(root, steps, leaf, depth)
        if padded > MAX_PADDING:
            raise FormatError(f"checkpoint {where}: manifest puts tensors at list positions needing more than "
                              f"{MAX_PADDING} empty slots before them; not written by us")


def template_from_manifest(man: Mapping[str, Any], metadata: Mapping[str, ShardedTensor], where: str) -> Dict[str, Any]:
    """A load template with each listed tensor whole (an empty CPU tensor of its global shape), in the
    containers the manifest describes. Loading it and merging the common state gives back the tree."""
    paths = manifest_paths(man, where)
    leaves: Dict[str, Any] = {}
    for key in paths:
        meta = metadata.get(key)
        if meta is None:
            raise FormatError(f"checkpoint {where}: manifest lists tensor {key!r} that metadata.json does not")
        shape = tuple(meta.global_shape)
        leaves[key] = ShardedTensor(key=key, data=torch.empty(shape, dtype=meta.dtype), dtype=meta.dtype,
                                    local_shape=shape, global_shape=shape, global_offset=(0,) * len(shape))
    root: Dict[str, Any] = {}
    place_at(root, paths, leaves, where)
    return root


def value_at(tree: Any, path: Tuple[Any, ...]) -> Any:
    """The node at ``path`` (keys and positions) of ``tree``."""
    for step in path:
        tree = tree[step]
    return tree


def put_value(tree: Any, path: Tuple[Any, ...], value: Any) -> None:
    value_at(tree, path[:-1])[path[-1]] = value


def leave_out(tree: Dict[str, Any], places: Sequence[Tuple[Dict[Any, Any], Any]]) -> Dict[str, Any]:
    """``tree`` (a save's), its entries at ``places`` (dict, key) left out: this rank's copies of replicated
    tensors that may differ by rank (buffers), which the main replica (rank 0) saves, as stock saves rank 0's.
    Called once the manifest is made, so that it is the same on every rank (it is common state)."""
    for node, key in places:
        del node[key]
    return tree
