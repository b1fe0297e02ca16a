"""``torch.distributed.tensor.DTensor`` leaves as sharded tensors, on save and on load.

:func:`shard_dtensors` replaces every DTensor leaf of a state dict (anywhere in the tree) by a
:class:`ShardedTensorFactory` keyed by the leaf's tree path, its dict keys and list positions
joined with ``"/"`` (``{"model": {"w": dt}}`` -> ``"model/w"``, ``{"opt": [dt]}`` -> ``"opt/0"``,
:mod:`.tree_paths`), whatever the mesh; plain tensors are keyed the same way (:mod:`.plain_tensors`).
The factory is expanded inside the save's and the load's own error handling (``prepare_save`` /
``make_request``), so a DTensor that cannot be described fails on every rank alike, before anything
is written, and never reaches the common state.

A DTensor becomes one :class:`ShardedTensor`: data its local shard, global shape ``dt.shape``,
global offset from the mesh coordinate and placements (torch's own
``compute_local_shape_and_global_offset``: ``Shard(dim)`` on any mesh dim, several mesh dims on one
tensor dim, uneven ``torch.chunk`` splits whose last shards may be empty), and a replica id made of
the coordinates on the ``Replicate()`` mesh dims, so exactly one replica of each shard is main.
A ``_StridedShard`` (FSDP2 over tensor parallel) is accepted where it still gives each rank one
contiguous slice; it and other placements (``Partial``, ...) otherwise raise :class:`ShardingError`
naming the key, as does a DTensor inside a tuple (a tuple is common state as a whole).

On load the loaded local shard is put back into the template's DTensor (its local tensor filled in
place): the result has the template's mesh and placements, whatever the checkpoint's split was.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Tuple

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from .errors import ShardingError
from .mapping import ReplicaId, ShardedTensor, ShardedTensorFactory
from .plain_tensors import same_memory
from .tree_paths import Steps, in_tuple, join_path, key_by_path, path_key


@dataclass(frozen=True)
class DTensorLayout:
    """Where this rank's local shard of a DTensor sits in the global tensor."""

    global_shape: Tuple[int, ...]
    local_shape: Tuple[int, ...]
    global_offset: Tuple[int, ...]
    replica_id: ReplicaId


#: The checkpoint key of a leaf at a path of dict keys and positions (kept for the strategies' callers).
dtensor_key = join_path


def dtensor_layout(key: str, dt: DTensor) -> DTensorLayout:
    """Describe ``dt``'s local shard on this rank, or raise :class:`ShardingError` naming ``key``."""
    mesh, placements = dt.device_mesh, tuple(dt.placements)
    for mesh_dim, p in enumerate(placements):
        if not isinstance(p, (Shard, Replicate, _StridedShard)):
            raise ShardingError(
                f"{key!r}: DTensor placement {p} on mesh dim {mesh_dim} (placements {placements}) cannot be saved "
                "as a sharded tensor: only Shard(dim) and Replicate() can (redistribute a Partial first, e.g. "
                "dt.redistribute(placements=[Replicate()]))"
            )
    global_shape = tuple(int(s) for s in dt.shape)
    if any(isinstance(p, _StridedShard) for p in placements) and not _strided_is_contiguous(
            global_shape, tuple(mesh.shape), placements):
        raise ShardingError(
            f"{key!r}: DTensor placements {placements} on mesh {tuple(mesh.shape)} give ranks non-contiguous "
            "slices of the tensor, which a sharded tensor cannot describe (redistribute to Shard / Replicate first)"
        )
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise ShardingError(f"{key!r}: this rank is not part of the DTensor's device mesh {mesh}")
    local_shape, offset = compute_local_shape_and_global_offset(global_shape, mesh, placements)
    actual = tuple(dt.to_local().shape)
    if tuple(local_shape) != actual:
        raise ShardingError(
            f"{key!r}: the DTensor's local tensor has shape {actual}, but its mesh {tuple(mesh.shape)} and "
            f"placements {placements} give {tuple(local_shape)} for mesh coordinate {coordinate}"
        )
    replicas = tuple(int(c) for c, p in zip(coordinate, placements) if isinstance(p, Replicate))
    return DTensorLayout(global_shape, actual, tuple(int(o) for o in offset), replicas if replicas else 0)


def _strided_is_contiguous(global_shape: Tuple[int, ...], mesh_shape: Tuple[int, ...],
                            placements: Sequence[Placement]) -> bool:
    """Whether every rank's slice is one contiguous range along each tensor dim a ``_StridedShard``
    splits (as FSDP2 over tensor parallel makes them). The ranges torch gives (first index, size)
    for all mesh coordinates on the mesh dims splitting that tensor dim must tile it: the slices
    partition the dim, so tiling ranges mean each slice is its range."""
    try:
        from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset as box_at
    except ImportError:  # a torch without the per-coordinate helper: the split cannot be checked
        return False
    for dim in {p.dim for p in placements if isinstance(p, _StridedShard)}:
        splitting = [i for i, p in enumerate(placements) if isinstance(p, (Shard, _StridedShard)) and p.dim == dim]
        spans = []
        for coords in itertools.product(*(range(mesh_shape[i]) for i in splitting)):
            coordinate = [0] * len(mesh_shape)
            for i, c in zip(splitting, coords):
                coordinate[i] = c
            shape, offset = box_at(global_shape, mesh_shape, coordinate, placements)
            if shape[dim]:
                spans.append((offset[dim], shape[dim]))
        end = 0
        for start, size in sorted(spans):
            if start != end:
                return False
            end += size
        if end != global_shape[dim]:
            return False
    return True


def dtensor_to_sharded(key: str, dt: DTensor) -> ShardedTensor:
    """The ShardedTensor of ``dt``'s local shard (its data shares the local tensor's memory)."""
    layout = dtensor_layout(key, dt)
    local = dt.to_local().detach()
    return ShardedTensor(
        key=key, data=local, dtype=local.dtype, local_shape=layout.local_shape,
        global_shape=layout.global_shape, global_offset=layout.global_offset, replica_id=layout.replica_id,
    )


def shard_dtensors(tree: Any) -> Any:
    """``tree`` with each DTensor leaf replaced by a factory that describes it as a ShardedTensor
    (on save and load) and puts the loaded shard back (on load). Containers on the way to a DTensor
    are copied (dicts as plain dicts); a tree without DTensors is returned as it is."""
    return key_by_path(tree, dtensor_factory)


def dtensor_factory(steps: Steps, node: Any) -> Optional[ShardedTensorFactory]:
    """The factory of the DTensor ``node`` at ``steps`` (keyed by its path), None for anything else."""
    if not isinstance(node, DTensor):
        return None
    build = _refuse_in_tuple if in_tuple(steps) else _build
    return ShardedTensorFactory(key=path_key(steps), data=node, build_fn=build,
                                merge_fn=functools.partial(restore_dtensor, node))


def _build(key: str, data: DTensor, replica_id: ReplicaId, flattened_range: Optional[slice]) -> ShardedTensor:
    """The factory's expansion: run where the save's and the load's errors are agreed over ranks."""
    return dtensor_to_sharded(key, data)


def _refuse_in_tuple(key: str, data: DTensor, replica_id: ReplicaId, flattened_range: Optional[slice]) -> Any:
    """A tuple is common state as a whole (sharded leaves live in dicts and lists): refuse, agreed."""
    raise ShardingError(f"{key!r}: a DTensor inside a tuple would be saved as common state: put it in a list or dict")


def restore_dtensor(template: DTensor, loaded: Any) -> DTensor:
    """Put the loaded local shard into ``template``'s local tensor (unless it was read in place)."""
    local = template.to_local().detach()
    if isinstance(loaded, torch.Tensor) and not same_memory(loaded, local):
        with torch.no_grad():
            local.copy_(loaded)
    return template
