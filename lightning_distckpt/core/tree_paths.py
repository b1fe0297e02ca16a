"""Leaves named by their place in the tree: the typed path of a leaf and the checkpoint key made of it.

A leaf's *steps* are the way down to it: ``("d", key)`` into a dict, ``("l", i)`` into a list,
``("t", i)`` into a tuple. Its *key* is the keys and positions joined with ``"/"``
(``{"model": {"w": t}}`` -> ``"model/w"``, ``{"opt": [t]}`` -> ``"opt/0"``): the key a DTensor or a
plain tensor leaf is stored under (:mod:`.dtensors`, :mod:`.plain_tensors`), the form Lightning
checkpoints and ``torch.save`` files name their tensors by. The steps keep what the key loses (a
list position or an int dict key, a ``"/"`` inside a key), so a leaf can be put back where it was.

:func:`key_by_path` is the one walk that replaces leaves by keyed entries; two leaves whose keys
coincide (``{"a/b": x, "a": {"b": y}}``, dict keys ``0`` and ``"0"``) are refused, naming both paths.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from .errors import FormatError, ShardingError
from .tree_walk import CONTAINERS, MAX_DEPTH, Build, keep_or_copy, map_paths

Step = Tuple[str, Any]  # ("d", dict key) | ("l", list index) | ("t", tuple index)
Steps = Tuple[Step, ...]
#: What a keyed leaf becomes: a replacement with a ``key`` attribute (keys checked for collisions),
#: another replacement without one (a value kept in the common state), or None to keep the leaf.
Convert = Callable[[Steps, Any], Optional[Any]]

JSON_KEYS = (str, int)  # the dict keys metadata.json gives back as they were (exact types: no bool)
# The dict keys a pickled path (a manifest in common.pt) gives back as they were: what a checkpoint's tree
# may be keyed by. A save names such a tensor by str(key); its load must find the same place again.
PICKLED_KEYS = (str, int, bool, float, bytes, tuple, type(None))


def step_of(node: Any, key: Any) -> Step:
    """The step from the container ``node`` to its child ``key``."""
    if isinstance(node, dict):
        return ("d", key)
    return ("t", key) if isinstance(node, tuple) else ("l", key)


def join_path(parts: Sequence[Any]) -> str:
    """The checkpoint key of the leaf reached by the dict keys and positions ``parts``, joined with ``"/"``."""
    if not parts:
        raise ShardingError("a tensor cannot be the whole state dict: it needs a key (put it in a dict)")
    return "/".join(str(p) for p in parts)


def path_key(steps: Sequence[Step]) -> str:
    """The checkpoint key of the leaf at ``steps`` (:func:`join_path` of its keys and positions)."""
    return join_path([k for _, k in steps])


def in_tuple(steps: Sequence[Step]) -> bool:
    """Whether the leaf lies inside a tuple (a tuple is common state as a whole)."""
    return any(kind == "t" for kind, _ in steps)


def show(steps: Sequence[Step]) -> str:
    """``steps`` as the Python subscripts that reach the leaf: ``['model'][0]['w']``."""
    return "".join(f"[{k!r}]" for _, k in steps) or "the top"


def key_by_path(tree: Any, convert: Convert, where: str = "the state dict", *,
                types: Tuple[type, ...] = CONTAINERS, build: Build = keep_or_copy) -> Any:
    """``tree`` with each leaf for which ``convert(steps, leaf)`` returns a replacement replaced by
    it. Containers on the way to a replaced leaf are copied (dicts as plain dicts); a container
    holding none is kept as it is, so a tree with nothing to replace is returned itself (``build``:
    another rule, e.g. :func:`~.tree_walk.copy_containers`). Containers are instances of ``types``.
    A bounded walk at every path (:func:`~.tree_walk.map_paths`: a dict under two keys is converted at each).

    Raises :class:`ShardingError` naming both paths when two replacements share a key."""
    seen: Dict[str, Steps] = {}

    def leaf(steps: Steps, value: Any) -> Any:
        out = convert(steps, value)
        if out is None:
            return value
        key = getattr(out, "key", None)
        if key is None:
            return out
        first = seen.setdefault(key, steps)
        if first != steps:
            raise ShardingError(f"{where}: the tensors at {show(first)} and {show(steps)} would both be stored as "
                                f"{key!r} (keys are paths joined with '/'): rename one of them")
        return out

    return map_paths(tree, leaf, build, where=where, types=types, step=step_of)


# -- steps stored in metadata.json, and put back -----------------------------------------------------
def steps_to_json(steps: Steps) -> Optional[List[List[Any]]]:
    """``steps`` as JSON (``[["d", "model"], ["l", 0]]``), or None when a dict key is neither a str
    nor an int (JSON would not give it back as it was)."""
    if any(type(k) not in JSON_KEYS for _, k in steps):
        return None
    return [[kind, k] for kind, k in steps]


def steps_from_json(value: Any, key: str, where: str, max_index: int, joined: bool = True,
                    dict_keys: Tuple[type, ...] = JSON_KEYS) -> Steps:
    """The steps stored for ``key``, checked: dict steps by a key of ``dict_keys`` (exact types; JSON's: a
    str or an int; :data:`PICKLED_KEYS` for steps read from a pickle), list steps by an index
    below ``max_index``, at most :data:`~.tree_walk.MAX_DEPTH` of them, joined they give ``key``
    (unless not ``joined``: a key chosen by a module, not by its place) (FormatError naming
    ``where`` otherwise: the file is not trusted)."""
    ok = isinstance(value, list) and 0 < len(value) <= MAX_DEPTH
    steps: List[Step] = []
    for step in value if ok else ():
        good = isinstance(step, list) and len(step) == 2 and (
            (step[0] == "d" and type(step[1]) in dict_keys)
            or (step[0] == "l" and type(step[1]) is int and 0 <= step[1] < max_index))
        if not good:
            ok = False
            break
        steps.append((step[0], step[1]))
    if not ok or joined and path_key(steps) != key:
        what = "joined with '/' giving the key" if joined else f"at most {MAX_DEPTH} of them"
        raise FormatError(f"{where}[{key!r}] must be the path of {key!r} ([['d', key] or ['l', index < {max_index}], "
                          f"...] {what}), got {str(value)[:200]}")
    return tuple(steps)


MISSING = object()  # value_at: nothing at that path


def value_at(tree: Any, steps: Steps) -> Any:
    """The value at ``steps`` in ``tree`` (dicts by key, lists and tuples by position), or MISSING."""
    node = tree
    for kind, k in steps:
        if kind == "d" and isinstance(node, dict) and k in node:
            node = node[k]
        elif kind in ("l", "t") and isinstance(node, (list, tuple)) and type(k) is int and 0 <= k < len(node):
            node = node[k]
        else:
            return MISSING
    return node


def free_place(tree: Dict[Any, Any], steps: Steps) -> Optional[int]:
    """How many of ``steps`` lead through containers of ``tree`` before the place is free (nothing
    there: an absent dict key, a list position past the end or holding None), or None when the
    place is taken (a leaf on the way or at the end, or a container of another kind)."""
    node: Any = tree
    for depth, (kind, k) in enumerate(steps):
        if kind == "d" and type(node) is dict:
            if k not in node:
                return depth
        elif kind == "l" and type(node) is list:
            if k >= len(node) or node[k] is None:
                return depth
        else:
            return None
        node = node[k]
    return None


def put_at(tree: Dict[Any, Any], steps: Steps, value: Any, depth: int) -> int:
    """Put ``value`` at ``steps``, the first ``depth`` of which lead through existing containers
    (:func:`free_place`), creating dicts and lists for the rest. Returns the list slots padded with None."""
    node: Any = tree
    for kind, k in steps[:depth]:
        node = node[k]
    padded = 0
    for i, (kind, k) in enumerate(steps[depth:], start=depth):
        last = i == len(steps) - 1
        fresh: Any = value if last else ({} if steps[i + 1][0] == "d" else [])
        if kind == "l":
            if len(node) <= k:
                padded += k + 1 - len(node)
                node.extend([None] * (k + 1 - len(node)))
        node[k] = fresh
        node = fresh
    return padded
