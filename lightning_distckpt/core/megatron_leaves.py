"""Megatron-Core's sharded state dicts as they are: their leaves become ours, on save and on load.

``megatron_model.sharded_state_dict()`` (and Megatron-Core's optimizers') return trees whose leaves
are ``megatron.core.dist_checkpointing.mapping``'s ``ShardedTensor``, ``ShardedObject``,
``ShardedTensorFactory`` and ``LocalNonpersistentObject``. They carry the same fields as
:mod:`lightning_distckpt.core.mapping`'s classes (our data model follows Megatron-Core's), so
:func:`from_megatron_leaves` copies each field into ours; a factory's ``build_fn`` output is
converted the same way when it is expanded. Leaves are recognized by their type's module name:
megatron-core is never imported here, and a tree without its leaves is returned as it is.
"""

from __future__ import annotations

import sys
from typing import Any, Callable

from .mapping import LocalNonpersistentObject, ShardedObject, ShardedTensor, ShardedTensorFactory
from .tree_walk import fold, keep_or_copy

_MEGATRON_MODULE = "megatron.core.dist_checkpointing"


def is_megatron_leaf(value: Any) -> bool:
    """A leaf of Megatron-Core's sharded state dicts (by its type's module; nothing imported)."""
    return type(value).__module__.startswith(_MEGATRON_MODULE)


def from_megatron_leaves(tree: Any) -> Any:
    """``tree`` with each Megatron-Core leaf replaced by ours. Containers on the way to one are
    copied (dicts as dicts of the same keys, lists as lists, tuples as tuples); a tree without
    Megatron-Core leaves is returned as it is."""
    if _MEGATRON_MODULE not in sys.modules:
        # No leaf can be of its types: importing any of its modules (unpickling one too) imports the
        # package first. Spares every save and load a walk of the tree (~0.5 ms for Lightning's).
        return tree
    return fold(tree, _leaf, keep_or_copy)  # bounded, each container once (core/tree_walk.py)


def _leaf(value: Any) -> Any:
    return _convert(value) if is_megatron_leaf(value) else value


def _convert(leaf: Any) -> Any:
    """One Megatron-Core leaf as ours; a type of that package we do not know is left as it is
    (common state, saved with torch.save, where the safe loader will name it on load)."""
    name = type(leaf).__name__
    if name == "ShardedTensor":
        return ShardedTensor(
            key=leaf.key, data=leaf.data, dtype=leaf.dtype, local_shape=leaf.local_shape,
            global_shape=leaf.global_shape, global_offset=leaf.global_offset,
            axis_fragmentations=leaf.axis_fragmentations, replica_id=leaf.replica_id,
            prepend_axis_num=leaf.prepend_axis_num, allow_shape_mismatch=leaf.allow_shape_mismatch,
            flattened_range=leaf.flattened_range)
    if name == "ShardedObject":
        return ShardedObject(key=leaf.key, data=leaf.data, global_shape=leaf.global_shape,
                             global_offset=leaf.global_offset, replica_id=leaf.replica_id)
    if name == "ShardedTensorFactory":
        return ShardedTensorFactory(key=leaf.key, data=leaf.data, build_fn=_converting(leaf.build_fn),
                                    merge_fn=leaf.merge_fn, replica_id=leaf.replica_id,
                                    flattened_range=leaf.flattened_range)
    if name == "LocalNonpersistentObject":
        return LocalNonpersistentObject(leaf.obj)
    return leaf


def _converting(build_fn: Callable[..., Any]) -> Callable[..., Any]:
    """A factory's build function whose output (Megatron-Core leaves) comes back as ours."""
    def build(*args: Any, **kwargs: Any) -> Any:
        return from_megatron_leaves(build_fn(*args, **kwargs))
    return build
