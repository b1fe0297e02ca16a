"""Walking nested state dicts: find, replace and split leaves; expand and merge factories.

Every walk goes through :mod:`.tree_walk`: iterative, depth-bounded, each container object once
where the result does not depend on the path, cycles refused, places bounded by what is stored."""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterator, List, Optional, Set, Tuple, Union

from .errors import FormatError, ShardingError
from .mapping import LocalNonpersistentObject, ShardedObject, ShardedTensor, ShardedTensorFactory
from .tree_walk import MAX_DEPTH, fold, rebuilt_tuple, walk_paths

Path = Tuple[Union[str, int], ...]
SHARDED_TYPES = (ShardedTensor, ShardedObject, ShardedTensorFactory, LocalNonpersistentObject)


def iter_leaves(tree: Any, where: str = "the state dict") -> Iterator[Tuple[Path, Any]]:
    """Yield ``(path, leaf)`` for every non-container leaf of nested dicts/lists/tuples, at every
    path (a shared dict's leaves under each of its keys), within the bounds of :mod:`.tree_walk`."""
    return iter(walk_paths(tree, where=where))


def map_leaves(fn: Callable[[Any], Any], tree: Any, where: str = "the state dict") -> Any:
    """A copy of the containers of ``tree`` with ``fn`` applied to each leaf (a container reached
    twice is copied once: the copy shares it as the tree did)."""
    return fold(tree, fn, _rebuild, where=where)


def _rebuild(node: Any, keys: Optional[List[Any]], results: List[Any]) -> Any:
    """A plain dict, a list or a tuple of ``node``'s own type (a namedtuple stays one) of ``results``."""
    if keys is not None:
        return dict(zip(keys, results))
    return results if isinstance(node, list) else rebuilt_tuple(node, results)


_EMPTY = object()  # split_common: nothing of this side here


def split_common(tree: Any, where: str = "the state dict") -> Tuple[Any, Any]:
    """Split into ``(sharded, common)``: two trees of the same containers, each holding only its leaves.

    Containers left empty on one side are dropped there, so the common tree is exactly the
    non-sharded state and merging the two gives back the original. Dicts and lists are containers
    (a tuple is a common value as a whole; a factory's expansion is sharded state through and through).
    """
    sh, co = fold(tree, _split_leaf, _split_node, where=where, types=(dict, list), leaves=(_FactoryExpansion,))
    return ({} if sh is _EMPTY else sh), ({} if co is _EMPTY else co)


def _split_leaf(node: Any) -> Tuple[Any, Any]:
    return (node, _EMPTY) if isinstance(node, _SHARDED_LEAVES) else (_EMPTY, node)


def _split_node(node: Any, keys: Optional[List[Any]], parts: List[Tuple[Any, Any]]) -> Tuple[Any, Any]:
    if keys is not None:
        sh, co = {}, {}
        for k, (s, c) in zip(keys, parts):
            if s is not _EMPTY:
                sh[k] = s
            if c is not _EMPTY:
                co[k] = c
        return (sh if sh or not node else _EMPTY), (co if co or not node else _EMPTY)
    # Lists keep positions: a hole is filled from the other side on merge.
    has_sh = any(s is not _EMPTY for s, _ in parts)
    has_co = any(c is not _EMPTY for _, c in parts)
    sh_list = [None if s is _EMPTY else s for s, _ in parts]
    co_list = [None if c is _EMPTY else c for _, c in parts]
    return (sh_list if has_sh else _EMPTY), (co_list if has_co or not node else _EMPTY)


def merge(base: Any, other: Any, where: str = "the state dict") -> Any:
    """Merge ``other`` into ``base`` (dicts by key, lists by position); ``other`` wins on leaves.

    Iterative, each pair of containers merged once, at most :data:`~.tree_walk.MAX_DEPTH` deep."""
    if not _mergeable(base, other):
        return other
    stack: List[Tuple[Any, Any, int]] = [(base, other, 1)]
    done: Set[Tuple[int, int]] = set()
    while stack:
        b, o, depth = stack.pop()
        if (id(b), id(o)) in done:
            continue
        done.add((id(b), id(o)))
        if isinstance(b, list) and len(b) < len(o):
            b.extend([None] * (len(o) - len(b)))
        for k, v in (o.items() if isinstance(o, dict) else enumerate(o)):
            if isinstance(b, list) and v is None:
                continue
            mine = b.get(k, _EMPTY) if isinstance(b, dict) else b[k]
            if mine is _EMPTY or mine is None and isinstance(b, list) or not _mergeable(mine, v):
                b[k] = v
            elif depth >= MAX_DEPTH:
                raise FormatError(f"{where}: nested more than {MAX_DEPTH} containers deep (merging at {k!r}); refused")
            else:
                stack.append((mine, v, depth + 1))
    return base


def _mergeable(base: Any, other: Any) -> bool:
    return isinstance(base, dict) and isinstance(other, dict) or isinstance(base, list) and isinstance(other, list)


def apply_factories(tree: Any, expanded: Optional[List[Tuple[ShardedTensorFactory, Any]]] = None) -> Any:
    """Replace each ShardedTensorFactory by its expansion (recursively); factories are kept aside
    in a ``_FactoryExpansion`` wrapper so :func:`merge_factories` can fold them back after load.
    ``expanded``: where given, each ``(factory, its expansion)`` is appended, in tree order."""

    def expand(leaf: Any) -> Any:
        if isinstance(leaf, ShardedTensorFactory):
            built = leaf.build()
            if built is None:
                raise ShardingError(f"{leaf.key!r}: ShardedTensorFactory.build_fn returned None")
            inner = map_leaves(expand, built)
            _refuse_unsharded(leaf.key, inner)
            if expanded is not None:
                expanded.append((leaf, inner))
            return _FactoryExpansion(leaf, inner)
        return leaf

    return map_leaves(expand, tree)


def _refuse_unsharded(key: str, expansion: Any) -> None:
    """A factory's expansion holds sharded entries only. Anything else there (the plain tensor a build_fn
    returned instead of its ShardedTensor, a number) would be neither saved (an expansion is sharded state
    through and through: no common state) nor read on load (its template value silently kept): refused,
    where a save or load agrees its errors over the ranks."""
    if isinstance(expansion, _SHARDED_LEAVES):
        return  # one entry: the usual build
    for path, value in iter_leaves(expansion, where=f"the expansion of factory {key!r}"):
        if not isinstance(value, _SHARDED_LEAVES):
            at = "".join(f"[{p!r}]" for p in path)
            raise ShardingError(f"{key!r}: ShardedTensorFactory.build_fn returned {type(value).__name__} "
                                f"{'at ' + at if at else 'as its expansion'}: a factory builds ShardedTensors, "
                                "ShardedObjects or factories (in dicts or lists), else it is neither saved nor loaded")


class _FactoryExpansion(dict):
    """The expansion of one factory: a dict with one entry, so tree walks see its sharded leaves."""

    def __init__(self, factory: ShardedTensorFactory, expanded: Any) -> None:
        super().__init__(__factory__=expanded)
        self.factory = factory


_SHARDED_LEAVES = (_FactoryExpansion,) + SHARDED_TYPES



def merge_factories(tree: Any, where: str = "the state dict") -> Any:
    """Fold each factory expansion (after load) back into a tensor with the factory's ``merge_fn``
    (dicts and lists changed in place; a tuple is a value as a whole)."""
    return fold(tree, _same, _merge_node, where=where, types=(dict, list))


def _merge_node(node: Any, keys: Optional[List[Any]], results: List[Any]) -> Any:
    if isinstance(node, _FactoryExpansion):
        return node.factory.merge_fn(results[0])
    return _assign(node, keys, results)


def _assign(node: Any, keys: Optional[List[Any]], results: List[Any]) -> Any:
    """``node`` (a dict or list) with its children replaced by ``results``, in place."""
    if keys is None:
        node[:] = results
    else:
        for k, r in zip(keys, results):
            node[k] = r
    return node


def _same(leaf: Any) -> Any:
    return leaf


def replace_leaves(tree: Any, fn: Callable[[Any], Any], where: str = "the state dict") -> Any:
    """In-place replacement of leaves (dicts, lists; tuples are rebuilt), each container once."""
    return fold(tree, fn, _replace_node, where=where)


def _replace_node(node: Any, keys: Optional[List[Any]], results: List[Any]) -> Any:
    return rebuilt_tuple(node, results) if isinstance(node, tuple) else _assign(node, keys, results)


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
