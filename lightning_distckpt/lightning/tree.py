"""Turning Lightning checkpoint dicts into sharded state dicts and back.

A checkpoint is saved as its natural tree: tensors become ShardedTensors in place, everything else
is common state. Next to it goes a small manifest (``MANIFEST_KEY``) listing where each
ShardedTensor sat (typed path steps), so that a checkpoint can be read back without a template:
each tensor whole, in its place (:func:`template_from_manifest`).
"""

from __future__ import annotations

from typing import Any, Dict, Iterator, List, Mapping, Optional, Tuple, Union

import torch
from torch.distributed.tensor import DTensor, Replicate

from ..core.errors import FormatError, ShardingError
from ..core.mapping import ShardedTensor
from ..core.tree_walk import fold, map_paths, walk_paths

MANIFEST_KEY = "__distckpt__"
MANIFEST_VERSION = 1
KIND_PLAIN = "plain"  # whole tensors saved by one process (stock DDP / single device)
KIND_SHARDED = "sharded"  # ShardedTensors from every rank (DistCheckpointStrategy, Fabric strategy)
# DTensors from every rank (DistCheckpointModelParallelStrategy): keyed by their path in the checkpoint
# dict, optimizer state by parameter name (torch.distributed.checkpoint.state_dict's layout)
KIND_MODEL_PARALLEL = "model_parallel"

# One step into a container: ("d", key) into a dict, ("l", index) into a list.
Step = Tuple[str, Union[str, int]]


def _step(node: Any, key: Union[str, int]) -> Step:
    return ("d", key) if isinstance(node, dict) else ("l", key)


def iter_tensor_leaves(tree: Any, where: str = "the checkpoint") -> Iterator[Tuple[Tuple[Step, ...], torch.Tensor]]:
    """Tensors reachable through dicts and lists (other containers are common state as they are),
    at every path (a bounded walk, :mod:`~lightning_distckpt.core.tree_walk`)."""
    for steps, leaf in walk_paths(tree, where=where, types=(dict, list), step=_step):
        if isinstance(leaf, torch.Tensor):
            yield steps, leaf


def key_of(steps: Tuple[Step, ...]) -> str:
    return "/".join(str(k) for _, k in steps)


def plain_to_sharded(checkpoint: Dict[str, Any]) -> Dict[str, Any]:
    """A copy of the containers of ``checkpoint`` with every tensor (1-d or more) replaced by a whole
    ShardedTensor keyed by its path (``state_dict/layer.weight``, ``optimizer_states/0/state/3/exp_avg``).
    Scalars (0-d tensors) stay common state. A DTensor replicated over its mesh is saved whole; a
    sharded one is refused (:func:`whole_dtensor`)."""
    seen: Dict[str, Tuple[Step, ...]] = {}

    def convert(steps: Tuple[Step, ...], node: Any) -> Any:
        if isinstance(node, DTensor):
            node = whole_dtensor(key_of(steps), node)
        if isinstance(node, torch.Tensor) and node.ndim > 0:
            key = key_of(steps)
            if key in seen:  # e.g. dict keys 0 and "0" side by side
                raise ShardingError(f"checkpoint entries {seen[key]} and {steps} would both be stored as {key!r}")
            seen[key] = steps
            data = node.detach()
            if data.layout != torch.strided:
                raise ShardingError(f"{key!r}: only dense (strided) tensors can be saved, got {data.layout}")
            return ShardedTensor.from_rank_offsets(key, data.contiguous())
        return node

    # keyed by path: a dict under two keys is converted at each (a bounded walk, tree_walk.py)
    return map_paths(checkpoint, convert, _copy, where="the checkpoint", types=(dict, list), step=_step)


def _copy(node: Any, keys: Optional[List[Any]], results: List[Any]) -> Any:
    return results if keys is None else dict(zip(keys, results))


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


def manifest(tree: Any, kind: str) -> Dict[str, Any]:
    """Where each ShardedTensor and DTensor of ``tree`` sits (factories' expansions are not listed:
    they can only be put back by their ``merge_fn``)."""
    paths: List[Tuple[List[Step], str]] = []
    for steps, node in walk_paths(tree, where="the checkpoint", types=(dict, list), step=_step):
        if isinstance(node, ShardedTensor) and node.flattened_range is None:
            paths.append((list(steps), node.key))
        elif isinstance(node, DTensor):  # saved under its tree path (core/dtensors.py): readable whole
            paths.append((list(steps), key_of(steps)))
    return {"version": MANIFEST_VERSION, "kind": kind, "tensor_paths": paths}


def torch_optimizer_states(tree: Any) -> Any:
    """Wherever a tree read whole holds optimizer state in the strategies' layout (state and param
    groups by parameter key), the same in ``torch.optim``'s layout (by parameter index, in param
    group order), so a stock strategy's ``optimizer.load_state_dict`` takes it (a bounded walk)."""
    return fold(tree, _same, _torch_layout, where="the checkpoint", types=(dict, list))


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
            and all(isinstance(p, str) for g in groups for p in g.get("params", []))
            and isinstance(node.get("state", {}), dict))


def template_from_manifest(man: Mapping[str, Any], metadata: Mapping[str, ShardedTensor], where: str) -> Dict[str, Any]:
    """A load template with each listed tensor whole (an empty CPU tensor of its global shape), in the
    containers the manifest describes. Loading it and merging the common state gives back the tree."""
    if not isinstance(man, Mapping) or man.get("version") != MANIFEST_VERSION:
        raise FormatError(f"checkpoint {where}: unknown {MANIFEST_KEY} manifest {man!r:.200}")
    root: Dict[str, Any] = {}
    for steps, key in man.get("tensor_paths", []):
        meta = metadata.get(key)
        if meta is None:
            raise FormatError(f"checkpoint {where}: manifest lists tensor {key!r} that metadata.json does not")
        shape = tuple(meta.global_shape)
        leaf = ShardedTensor(key=key, data=torch.empty(shape, dtype=meta.dtype), dtype=meta.dtype, local_shape=shape,
                             global_shape=shape, global_offset=(0,) * len(shape))
        put_at(root, [tuple(s) for s in steps], leaf, where)
    return root


def put_at(root: Dict[str, Any], steps: List[Step], leaf: Any, where: str) -> None:
    """Put ``leaf`` at the typed path ``steps`` under ``root``, creating the containers on the way."""
    node: Any = root
    for i, (kind, k) in enumerate(steps):
        last = i == len(steps) - 1
        nxt_kind = None if last else steps[i + 1][0]
        fresh: Any = leaf if last else ({} if nxt_kind == "d" else [])
        if kind == "d" and isinstance(node, dict):
            if last:
                node[k] = leaf
            node = node.setdefault(k, fresh)
        elif kind == "l" and isinstance(node, list):
            assert isinstance(k, int)
            if len(node) <= k:
                node.extend([None] * (k + 1 - len(node)))
            if last or node[k] is None:
                node[k] = fresh
            node = node[k]
        else:
            raise FormatError(f"checkpoint {where}: manifest path {steps} does not fit its containers")
