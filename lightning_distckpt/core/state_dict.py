"""Walking nested state dicts: find, replace and split leaves; expand and merge factories."""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterator, List, Tuple, Union

from .errors import ShardingError
from .mapping import LocalNonpersistentObject, ShardedObject, ShardedTensor, ShardedTensorFactory

Path = Tuple[Union[str, int], ...]
SHARDED_TYPES = (ShardedTensor, ShardedObject, ShardedTensorFactory, LocalNonpersistentObject)


def iter_leaves(tree: Any, path: Path = ()) -> Iterator[Tuple[Path, Any]]:
    """Yield ``(path, leaf)`` for every non-container leaf of nested dicts/lists/tuples."""
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from iter_leaves(v, path + (k,))
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            yield from iter_leaves(v, path + (i,))
    else:
        yield path, tree


def map_leaves(fn: Callable[[Any], Any], tree: Any) -> Any:
    """A copy of the containers of ``tree`` with ``fn`` applied to each leaf."""
    if isinstance(tree, dict):
        return {k: map_leaves(fn, v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [map_leaves(fn, v) for v in tree]
    if isinstance(tree, tuple):
        return tuple(map_leaves(fn, v) for v in tree)
    return fn(tree)


def split_common(tree: Any) -> Tuple[Any, Any]:
    """Split into ``(sharded, common)``: two trees of the same containers, each holding only its leaves.

    Containers left empty on one side are dropped there, so the common tree is exactly the
    non-sharded state and merging the two gives back the original.
    """
    _EMPTY = object()

    def split(node: Any) -> Tuple[Any, Any]:
        if isinstance(node, _FactoryExpansion):
            return node, _EMPTY  # a factory's expansion is sharded state through and through
        if isinstance(node, dict):
            sh, co = {}, {}
            for k, v in node.items():
                s, c = split(v)
                if s is not _EMPTY:
                    sh[k] = s
                if c is not _EMPTY:
                    co[k] = c
            return (sh if sh or not node else _EMPTY), (co if co or not node else _EMPTY)
        if isinstance(node, list):
            # Lists keep positions: a hole is filled from the other side on merge.
            parts = [split(v) for v in node]
            sh = [None if s is _EMPTY else s for s, _ in parts]
            co = [None if c is _EMPTY else c for _, c in parts]
            has_sh = any(s is not _EMPTY for s, _ in parts)
            has_co = any(c is not _EMPTY for _, c in parts)
            return (sh if has_sh else _EMPTY), (co if has_co or not node else _EMPTY)
        if isinstance(node, SHARDED_TYPES):
            return node, _EMPTY
        return _EMPTY, node

    sh, co = split(tree)
    return ({} if sh is _EMPTY else sh), ({} if co is _EMPTY else co)


def merge(base: Any, other: Any) -> Any:
    """Merge ``other`` into ``base`` (dicts by key, lists by position); ``other`` wins on leaves."""
    if isinstance(base, dict) and isinstance(other, dict):
        for k, v in other.items():
            base[k] = merge(base[k], v) if k in base else v
        return base
    if isinstance(base, list) and isinstance(other, list):
        if len(base) < len(other):
            base.extend([None] * (len(other) - len(base)))
        for i, v in enumerate(other):
            if v is None:
                continue
            base[i] = merge(base[i], v) if base[i] is not None else v
        return base
    return other


def apply_factories(tree: Any) -> Any:
    """Replace each ShardedTensorFactory by its expansion (recursively); factories are kept aside
    in a ``_FactoryExpansion`` wrapper so :func:`merge_factories` can fold them back after load."""

    def expand(leaf: Any) -> Any:
        if isinstance(leaf, ShardedTensorFactory):
            built = leaf.build()
            if built is None:
                raise ShardingError(f"{leaf.key!r}: ShardedTensorFactory.build_fn returned None")
            return _FactoryExpansion(leaf, map_leaves(expand, built))
        return leaf

    return map_leaves(expand, tree)


class _FactoryExpansion(dict):
    """The expansion of one factory: a dict with one entry, so tree walks see its sharded leaves."""

    def __init__(self, factory: ShardedTensorFactory, expanded: Any) -> None:
        super().__init__(__factory__=expanded)
        self.factory = factory


def merge_factories(tree: Any) -> Any:
    """Fold each factory expansion (after load) back into a tensor with the factory's ``merge_fn``."""
    if isinstance(tree, _FactoryExpansion):
        return tree.factory.merge_fn(merge_factories(tree["__factory__"]))
    if isinstance(tree, dict):
        for k in list(tree):
            tree[k] = merge_factories(tree[k])
        return tree
    if isinstance(tree, list):
        for i, v in enumerate(tree):
            tree[i] = merge_factories(v)
        return tree
    return tree


def replace_leaves(tree: Any, fn: Callable[[Any], Any]) -> Any:
    """In-place replacement of leaves (dicts, lists; tuples are rebuilt)."""
    if isinstance(tree, dict):
        for k in list(tree):
            tree[k] = replace_leaves(tree[k], fn)
        return tree
    if isinstance(tree, list):
        for i, v in enumerate(tree):
            tree[i] = replace_leaves(v, fn)
        return tree
    if isinstance(tree, tuple):
        return tuple(replace_leaves(v, fn) for v in tree)
    return fn(tree)


def collect(tree: Any) -> Dict[str, List[Any]]:
    """Group the sharded leaves of ``tree`` by kind: tensors, objects, nonpersistent."""
    out: Dict[str, List[Any]] = {"tensors": [], "objects": [], "nonpersistent": []}
    for _, leaf in iter_leaves(tree):
        if isinstance(leaf, ShardedTensor):
            out["tensors"].append(leaf)
        elif isinstance(leaf, ShardedObject):
            out["objects"].append(leaf)
        elif isinstance(leaf, LocalNonpersistentObject):
            out["nonpersistent"].append(leaf)
        elif isinstance(leaf, ShardedTensorFactory):
            raise ShardingError(f"{leaf.key!r}: factory was not expanded (call apply_factories first)")
    return out
