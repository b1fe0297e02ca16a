"""A Lightning checkpoint read back with its dicts' keys in the order they were saved in.

A save splits the tree: tensors go to the sharded state, everything else to the common state
(``common.pt``), and a load merges the tensors back into the common state, so a key whose value is
a tensor (or a dict of tensors only) comes back after its common siblings: ``{"epoch", "state_dict",
"loops"}`` read back as ``{"epoch", "loops", "state_dict"}``, where ``torch.load`` of a stock checkpoint
keeps the order. Iteration order is part of what a dict gives back (``list(ckpt)``, a re-save, a
printout, a hook iterating its checkpoint, ``set_extra_state``), so the manifest records the key order of
each dict the merge would reorder (``key_orders``: ``[steps, keys]``, only for those dicts) and every read,
whole or by a strategy's restore, puts it back; a ``torch.save`` file read by a strategy gives its own. A
checkpoint without the record reads as before (the merge's order); a reader that predates it ignores it.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Mapping, Tuple

import torch

from ..core.errors import FormatError
from ..core.state_dict import SHARDED_TYPES
from ..core.tree_paths import MISSING, PICKLED_KEYS, Steps, steps_from_json, value_at
from ..core.tree_walk import MAX_DEPTH
from ..reading.plain_tensors import MAX_LIST_INDEX

ORDERS_KEY = "key_orders"
MAX_ORDERS = 1 << 16  # dicts a manifest may reorder (a Lightning checkpoint has a few)
MAX_KEYS = 1 << 20  # keys all of them together may list
PlainMoves = Callable[[Tuple[Any, ...], torch.Tensor], bool]


def in_saved_order(tree: Dict[Any, Any], like: Mapping[Any, Any]) -> None:
    """Put ``tree``'s keys (in place) in the order of ``like``'s, the dict it was built from; keys
    ``like`` does not have go last, in their order (the strategies build the module's and optimizers'
    entries after the rest)."""
    _put_first(tree, [k for k in like if k in tree])


def _put_first(node: Dict[Any, Any], first: List[Any]) -> None:
    """``node``'s keys ``first`` (all in it, each once) first in that order, the rest after in theirs: in place."""
    if list(node)[:len(first)] == first:
        return
    ahead = set(first)
    items = [(k, node[k]) for k in first] + [(k, v) for k, v in node.items() if k not in ahead]
    node.clear()
    node.update(items)


def key_orders(tree: Any, plain_moves: PlainMoves) -> List[List[Any]]:
    """``[steps, keys]`` for each dict of ``tree`` whose keys a load gives back in another order: one where a
    key whose value leaves the common state comes before one whose value stays (at least in part).
    ``plain_moves(steps, tensor)``: whether a plain tensor leaf at ``steps`` is stored as a tensor (a save
    keys it by path where it can) or kept in the common state (the plugin's 0-d tensors). ``tree`` has been
    walked within :mod:`~lightning_distckpt.core.tree_walk`'s bounds first (no cycles, at most ``MAX_DEPTH``
    deep, its places bounded). Dicts reached through keys a pickled manifest would not give back as they
    were are left out (read in the merge's order)."""
    out: List[List[Any]] = []
    _fate(tree, (), out, plain_moves)
    return out


def _fate(node: Any, steps: Tuple[Any, ...], out: List[List[Any]], plain_moves: PlainMoves) -> Tuple[bool, bool]:
    """Whether ``node`` leaves the common state whole, and whether any of it stays there (recording the
    orders below it on the way)."""
    if isinstance(node, (dict, list)):
        kind, pairs = ("d", node.items()) if isinstance(node, dict) else ("l", enumerate(node))
        fates = [_fate(v, steps + ([kind, k],), out, plain_moves) for k, v in pairs]
        moved = [i for i, (moves, _) in enumerate(fates) if moves]
        if kind == "d" and moved and any(stay for _, stay in fates[moved[0] + 1:]) and _recordable(steps, node):
            out.append([list(steps), list(node)])
        return bool(fates) and len(moved) == len(fates), not fates or any(stay for _, stay in fates)
    moves = isinstance(node, SHARDED_TYPES) or isinstance(node, torch.Tensor) and plain_moves(steps, node)
    return moves, not moves


def _recordable(steps: Tuple[Any, ...], node: Dict[Any, Any]) -> bool:
    return all(type(k) in PICKLED_KEYS for _, k in steps) and all(type(k) in PICKLED_KEYS for k in node)


def common_first(merged: Any, common: Any) -> None:
    """Put each dict of ``merged`` (in place) in the order a merge into the common state gives: the keys
    ``common`` has first, in its order, then the rest (the tensors read) in theirs, for a merge made the
    other way round (into the tensors read, so that the stored values win). :func:`restore_key_orders`
    then puts them in the saved order. ``merged`` was merged from ``common`` (bounded there); each pair
    of containers is visited once, as the merge did (a shared sub-tree is not walked again)."""
    stack, seen = [(merged, common)], set()
    while stack:
        m, c = stack.pop()
        if (id(m), id(c)) in seen:
            continue
        seen.add((id(m), id(c)))
        if isinstance(m, dict) and isinstance(c, dict):
            stack.extend((m[k], c[k]) for k in c if k in m)
            _put_first(m, [k for k in c if k in m])
        elif isinstance(m, list) and isinstance(c, list):
            stack.extend(zip(m, c))


def recorded_orders(man: Any) -> Any:
    """The key orders a manifest read from a checkpoint records (unchecked: :func:`restore_key_orders` checks)."""
    return man.get(ORDERS_KEY, []) if isinstance(man, Mapping) else []


def restore_key_orders(state: Dict[Any, Any], entries: Any, where: str) -> None:
    """Put the dicts of ``state`` (a checkpoint read) in the key orders ``entries`` record, in place.
    A dict not there (left out of the read) is skipped; a key not listed stays after the listed ones.
    The record comes from the checkpoint: a malformed one is a FormatError naming ``where``."""
    if not isinstance(entries, list) or len(entries) > MAX_ORDERS:
        raise FormatError(f"checkpoint {where}: manifest {ORDERS_KEY} must be a list of at most {MAX_ORDERS} "
                          f"entries, got {entries!r:.200}")
    listed = 0
    for entry in entries:
        steps, keys = _checked(entry, where)
        listed += len(keys)
        if listed > MAX_KEYS:
            raise FormatError(f"checkpoint {where}: manifest {ORDERS_KEY} lists more than {MAX_KEYS} keys")
        node = value_at(state, steps) if steps else state
        if node is not MISSING and isinstance(node, dict):
            _reorder(node, keys, where)


def _checked(entry: Any, where: str) -> Tuple[Steps, List[Any]]:
    if not (isinstance(entry, (list, tuple)) and len(entry) == 2 and isinstance(entry[0], list)
            and all(isinstance(s, (list, tuple)) for s in entry[0])
            and isinstance(entry[1], list) and all(type(k) in PICKLED_KEYS for k in entry[1])):
        raise FormatError(f"checkpoint {where}: manifest {ORDERS_KEY} entry must be [steps, keys], "
                          f"got {entry!r:.200}")
    raw = [list(s) for s in entry[0]]
    try:
        steps = steps_from_json(raw, "", where, MAX_LIST_INDEX, joined=False, dict_keys=PICKLED_KEYS) if raw else ()
    except FormatError:
        raise FormatError(f"checkpoint {where}: manifest {ORDERS_KEY} steps must be ['d', key] or ['l', index < "
                          f"{MAX_LIST_INDEX}], at most {MAX_DEPTH} of them, got {raw!r:.200}") from None
    return steps, entry[1]


def _reorder(node: Dict[Any, Any], keys: List[Any], where: str) -> None:
    try:
        first = list(dict.fromkeys(k for k in keys if k in node))  # each once, as a dict has it
    except TypeError as e:  # a tuple key holding something unhashable: not written by us
        raise FormatError(f"checkpoint {where}: manifest {ORDERS_KEY} has a key that cannot be one ({e})") from None
    _put_first(node, first)
