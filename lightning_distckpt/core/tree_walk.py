"""The one walk over nested containers (state dicts, common state, loaded pickles): bounded.

A tree read from a file is data, and a small file can describe a huge or endless tree: pickles
keep shared references, so ``a = [x, x]; b = [a, a]; ...`` 40 levels deep is 2 KB on disk and
2**40 paths; a list can contain itself; nesting can be deeper than Python's recursion limit. Every
walk of such a tree goes through this module, which

* recurses at most :data:`MAX_DEPTH` containers deep (about as many Python frames, far below the
  interpreter's limit; a recursive walk is several times faster than an explicit stack here, and
  the save and load paths walk every state dict): a deeper tree is a :class:`FormatError` naming
  the depth, the place and the file, never a ``RecursionError``;
* visits each container object once by ``id()`` where the result does not depend on the path
  (:func:`fold`: the result for a shared sub-tree is computed once and shared, as in the input),
  and refuses a container that contains itself (a cycle);
* bounds what a walk may cost against what is stored. A tree's *places* are its nodes counted at
  every path that reaches them (what a walk path by path visits); its *stored nodes* are the
  containers once each plus every reference to a child (what the file had to spell out). The rule:
  **places <= max(MIN_PLACES, SHARING_FACTOR x stored nodes)** and stored nodes <= :data:`MAX_NODES`.
  A tree without shared containers has as many places as stored nodes, so it always passes; a state
  dict whose ``"ema"`` is its ``"model"`` dict has twice as many and passes; the 2 KB file above
  is refused after at most ``MIN_PLACES`` steps, not walked for days. :func:`fold` counts places
  without expanding them; :func:`walk_paths` (path by path) checks as it goes, so what any walk
  costs is bounded by the bytes that describe the tree.

Leaves are not containers: a tensor under two keys (tied weights) is a leaf at each of its places,
exactly as it is without this module. Which objects are containers is the caller's choice (the
``types`` and ``leaves`` arguments): dicts, lists and tuples (subclasses too) by default.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Set, Tuple, Type

from .errors import CheckpointingError, FormatError
from .gc_pause import gc_paused

MAX_DEPTH = 100  # containers nested; real state dicts nest about 10 (optimizer state: 5)
MIN_PLACES = 1 << 16  # places any tree may have, whatever it stores
SHARING_FACTOR = 4  # places per stored node beyond MIN_PLACES
MAX_NODES = 1 << 26  # stored nodes of one tree

Key = Any
Path = Tuple[Key, ...]
Build = Callable[[Any, Optional[List[Key]], List[Any]], Any]


class Limits(NamedTuple):
    """The bounds of a walk (the module constants by default; tests use smaller ones)."""

    max_depth: int = MAX_DEPTH
    min_places: int = MIN_PLACES
    sharing_factor: int = SHARING_FACTOR
    max_nodes: int = MAX_NODES


LIMITS = Limits()
CONTAINERS = (dict, list, tuple)
_STEP_KINDS = ("d", "l", "t")
_OPEN = object()  # memo mark of a container being walked: meeting it again is a cycle


class _Walk:
    """One walk: its containers (instances of ``types`` but not of ``leaves``), its counts
    (places walked, nodes stored, see the module docstring) and the errors it raises."""

    def __init__(self, where: str, types: Tuple[type, ...], leaves: Tuple[type, ...], limits: Limits,
                 error: Type[CheckpointingError]) -> None:
        self.where, self.types, self.leaves, self.limits, self.error = where, types, leaves, limits, error
        self.places = self.stored = 1  # the top

    def is_container(self, node: Any) -> bool:
        return isinstance(node, self.types) and not (self.leaves and isinstance(node, self.leaves))

    def enter(self, depth: int, path: Callable[[], Path]) -> None:
        if depth > self.limits.max_depth:
            raise self.error(f"{self.where}: nested more than {self.limits.max_depth} containers deep (at "
                             f"{_show(path())}); refused (a state dict nests a few levels)")

    def cycle(self, path: Path) -> CheckpointingError:
        return self.error(f"{self.where}: the container at {_show(path)} contains itself (a reference cycle); "
                          "refused")

    def not_rebuilt(self, path: Path, e: NotRebuilt) -> CheckpointingError:
        return self.error(f"{self.where}: the value at {_show(path)}: {e}; refused rather than given back as "
                          "another type")

    def check(self, path: Callable[[], Path]) -> None:
        """The places walked so far within the rule for the nodes stored so far."""
        limits = self.limits
        if self.places <= limits.min_places and self.stored <= limits.max_nodes:
            return
        if self.stored > limits.max_nodes:
            raise self.error(f"{self.where}: more than {limits.max_nodes} containers and values; refused")
        allowed = max(limits.min_places, limits.sharing_factor * self.stored)
        if self.places > allowed:
            raise self.error(
                f"{self.where}: shared containers make the tree {_count(self.places)} or more nodes when walked "
                f"path by path (at {_show(path())}), from {self.stored} stored: more than the {allowed} allowed "
                f"(max({limits.min_places}, {limits.sharing_factor} x stored)); refused")


def _show(path: Sequence[Key]) -> str:
    # typed steps (core/tree_paths.py: ("d", key), ("l", index), ("t", index)) are shown by their keys
    keys = (p[1] if type(p) is tuple and len(p) == 2 and p[0] in _STEP_KINDS else p for p in path)
    text = "/".join(map(str, keys)) or "the top"
    return text if len(text) <= 200 else text[:100] + " ... " + text[-95:]


def _count(n: int) -> str:
    return str(n) if n < 10**15 else f"about 2**{n.bit_length() - 1}"


class NotRebuilt(TypeError):
    """A tuple of a type that cannot be made again from its items (raised by :func:`rebuilt_tuple`; the
    walks raise their own error naming the place instead)."""


def rebuilt_tuple(node: Tuple[Any, ...], results: List[Any]) -> Tuple[Any, ...]:
    """A tuple of ``results`` of ``node``'s own type: a namedtuple stays that namedtuple (``_make``), a
    ``torch.return_types`` / structseq its type, a plain tuple a plain tuple. A subclass whose items are
    all unchanged is ``node`` itself (tuples are immutable: sharing it changes nothing). Raises
    :class:`NotRebuilt` for a subclass that cannot be made from its items: handing back a plain tuple
    in its place would be a silently wrong value."""
    kind = type(node)
    if kind is tuple:
        return tuple(results)
    if len(results) == len(node) and all(a is b for a, b in zip(results, node)):
        return node
    make = getattr(kind, "_make", None)
    try:
        out = make(results) if callable(make) and hasattr(kind, "_fields") else kind(results)
    except Exception as e:  # a subclass's own constructor: anything it raises means "not from items"
        raise NotRebuilt(f"a {kind.__module__}.{kind.__qualname__} (a tuple subclass) cannot be made again from "
                         f"its {len(results)} items: {type(e).__name__}: {e}") from None
    if type(out) is not kind or len(out) != len(results):
        raise NotRebuilt(f"a {kind.__module__}.{kind.__qualname__} (a tuple subclass) made from its {len(results)} "
                         f"items is not one of {len(results)} items")
    return out


def keep_or_copy(node: Any, keys: Optional[List[Any]], results: List[Any]) -> Any:
    """A ``Build`` for :func:`fold` / :func:`map_paths`: ``node`` itself when none of its children
    changed, else a copy holding the new ones (dicts as plain dicts, lists as lists, tuples as tuples
    of their own type: :func:`rebuilt_tuple`)."""
    old = node.values() if keys is not None else node
    if all(a is b for a, b in zip(results, old)):
        return node
    if keys is not None:
        return dict(zip(keys, results))
    return results if isinstance(node, list) else rebuilt_tuple(node, results)


def copy_containers(node: Any, keys: Optional[List[Any]], results: List[Any]) -> Any:
    """A ``Build`` that always copies: dicts as plain dicts, sequences as lists of the new children."""
    return results if keys is None else dict(zip(keys, results))


def fold(tree: Any, leaf: Callable[[Any], Any], build: Build, *, where: str = "the state dict",
         types: Tuple[type, ...] = CONTAINERS, leaves: Tuple[type, ...] = (), limits: Limits = LIMITS,
         error: Type[CheckpointingError] = FormatError) -> Any:
    """The tree folded bottom-up: ``leaf(value)`` at every leaf occurrence, ``build(container,
    keys, results)`` once per container object (``keys``: a dict's keys in order, None for a
    sequence; ``results``: its children's results in order), memoised by ``id()``: a sub-tree reached
    twice is built once and its result used at both places. Containers are instances of ``types``
    (subclasses too) that are not instances of ``leaves``.

    Raises ``error`` (FormatError by default) naming ``where`` for a tree too deep (at any of its
    places: a shared sub-tree met again deeper down counts with its height there), a cycle, or more
    places than the rule in the module docstring allows. ``build`` may change ``container`` in place
    (its children are all read before it is called)."""
    walk = _Walk(where, types, leaves, limits, error)
    if not walk.is_container(tree):
        return leaf(tree)
    # id -> (the container, kept alive; result or _OPEN; places; height: containers on its deepest path)
    memo: Dict[int, Tuple[Any, Any, int, int]] = {}
    keys_on_stack: List[Key] = []
    max_depth, quiet = limits.max_depth, min(limits.min_places, limits.max_nodes)

    # Hot: every save and load folds its state dicts. Locals, no calls but leaf/build per node.
    def down(node: Any, depth: int) -> Any:
        if depth > max_depth:
            walk.enter(depth, lambda: tuple(keys_on_stack))
        memo[id(node)] = (node, _OPEN, 0, 0)
        start = walk.places
        n = len(node)
        walk.places += n  # each child is a place and a stored reference; a container child adds its own
        walk.stored += n
        results = []
        append = results.append
        below = 0  # the height of the tallest container child
        for key, child in (node.items() if isinstance(node, dict) else enumerate(node)):
            if not isinstance(child, types) or leaves and isinstance(child, leaves):
                append(leaf(child))
                continue
            seen = memo.get(id(child))
            if seen is None:
                keys_on_stack.append(key)
                append(down(child, depth + 1))
                keys_on_stack.pop()
                seen = memo[id(child)]
            elif seen[1] is _OPEN:
                raise walk.cycle(tuple(keys_on_stack) + (key,))
            else:  # a shared sub-tree, built at its first place: as deep here as its height says
                if depth + seen[3] > max_depth:
                    walk.enter(depth + seen[3], lambda: tuple(keys_on_stack) + (key,))
                walk.places += seen[2] - 1
                append(seen[1])
            below = max(below, seen[3])
        if walk.places > quiet or walk.stored > quiet:
            walk.check(lambda: tuple(keys_on_stack))
        try:
            result = build(node, list(node) if isinstance(node, dict) else None, results)
        except NotRebuilt as e:
            raise walk.not_rebuilt(tuple(keys_on_stack), e) from None
        memo[id(node)] = (node, result, walk.places - start + 1, below + 1)
        return result

    with gc_paused():  # a memo entry per container: collections during the walk would find nothing
        return down(tree, 1)


def check_tree(tree: Any, where: str, *, types: Tuple[type, ...] = CONTAINERS, leaves: Tuple[type, ...] = (),
               limits: Limits = LIMITS, error: Type[CheckpointingError] = FormatError) -> None:
    """Refuse (``error`` naming ``where``) a tree that any walk of it would refuse: too deep, a
    cycle, too many places for what it stores. Each container is visited once."""
    fold(tree, _nothing, _nothing, where=where, types=types, leaves=leaves, limits=limits, error=error)


def _nothing(*_: Any) -> None:
    return None


def walk_paths(tree: Any, *, where: str = "the state dict", types: Tuple[type, ...] = CONTAINERS,
               leaves: Tuple[type, ...] = (), step: Optional[Callable[[Any, Key], Any]] = None,
               limits: Limits = LIMITS, error: Type[CheckpointingError] = FormatError) -> List[Tuple[Path, Any]]:
    """``(path, leaf)`` for every leaf at every path, depth first in the containers' order: a shared
    sub-tree is walked at each place it appears (tied weights and shared dicts keep every name),
    within the bounds of the module docstring, checked as the walk goes (``error`` naming ``where``).
    ``step(container, key)`` is a path's element (default: the key)."""
    out: List[Tuple[Path, Any]] = []

    def visit(path: Path, leaf: Any) -> None:
        out.append((path, leaf))

    map_paths(tree, visit, None, where=where, types=types, leaves=leaves, step=step, limits=limits, error=error)
    return out


def map_paths(tree: Any, leaf: Callable[[Path, Any], Any], build: Optional[Build], *,
              where: str = "the state dict", types: Tuple[type, ...] = CONTAINERS, leaves: Tuple[type, ...] = (),
              step: Optional[Callable[[Any, Key], Any]] = None, limits: Limits = LIMITS,
              error: Type[CheckpointingError] = FormatError) -> Any:
    """The tree folded bottom-up at every path: ``leaf(path, value)`` at each leaf of each place,
    ``build(container, keys, results)`` at each place of each container (a shared sub-tree is built
    once per place: use it where the result depends on the path; None: results are not kept).
    Bounded as the module docstring says, checked as the walk goes (``error`` naming ``where``)."""
    walk = _Walk(where, types, leaves, limits, error)
    if not walk.is_container(tree):
        return leaf((), tree)
    seen: Set[int] = set()
    open_ids: Set[int] = set()
    max_depth, quiet = limits.max_depth, min(limits.min_places, limits.max_nodes)

    def down(node: Any, path: Path, first: bool) -> Any:
        if len(path) >= max_depth:
            walk.enter(len(path) + 1, lambda: path)
        open_ids.add(id(node))
        seen.add(id(node))
        n = len(node)
        walk.places += n
        if first:  # a repeat's references are not in the file again
            walk.stored += n
        if walk.places > quiet or walk.stored > quiet:
            walk.check(lambda: path)
        results: List[Any] = []
        for key, child in (node.items() if isinstance(node, dict) else enumerate(node)):
            here = path + ((key if step is None else step(node, key)),)
            if not isinstance(child, types) or leaves and isinstance(child, leaves):
                results.append(leaf(here, child))
            elif id(child) in open_ids:
                raise walk.cycle(here)
            else:
                results.append(down(child, here, first and id(child) not in seen))
        open_ids.discard(id(node))
        if build is None:
            return None
        try:
            return build(node, list(node) if isinstance(node, dict) else None, results)
        except NotRebuilt as e:
            raise walk.not_rebuilt(path, e) from None

    with gc_paused():
        return down(tree, (), True)
