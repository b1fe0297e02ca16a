"""Tied tensors stored once (format 8): a key whose every shard was, on every rank, the very memory of
another key's shard is not written; ``metadata.json``'s ``aliases`` names the key it is read from.

A save finds the candidates locally (:func:`local_ties`: which of this rank's shards are the same memory)
and decides on the coordinator from every rank's records (:func:`decide_aliases`), so every rank agrees
and a tie on some ranks only is written twice, as before. A reader serves an alias from its target's
stored shards (:func:`parse_aliases` puts the target's entry under the alias's key).
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any, Dict, Iterable, List, Optional, Sequence, Tuple

from ..core.errors import FormatError
from ..core.shown import quoted

if TYPE_CHECKING:
    from ..core.mapping import ShardedTensor
    from .groups import RankRecords, RecordGroup
    from .metadata import TensorEntry

#: Ties of shards smaller than this are written twice: looking for them would cost every small tensor of
#: a state a lookup (10,000 norms and biases) to save a few kilobytes.
TIE_MIN_BYTES = 64 * 1024
#: The most aliases one stored tensor may have in a checkpoint read: a real tie names a tensor a few times;
#: a metadata.json naming one thousands of times (a hundred bytes each) would have every export write its
#: bytes once per name.
MAX_ALIASES_PER_TARGET = 64


def local_ties(tensors: Sequence["ShardedTensor"]) -> Dict[int, str]:
    """position -> the smallest other key whose shard at that position is exactly the same memory: same
    data pointer, shape, strides, dtype, global offset, local shard shape, flattened range and global
    shape. Only shards of at least ``TIE_MIN_BYTES`` are looked at."""
    seen: Dict[Tuple[Any, ...], List[int]] = {}
    for i, st in enumerate(tensors):
        d = st.data
        if d is None or d.nbytes < TIE_MIN_BYTES or d.device.type == "meta":
            continue
        fr = st.flattened_range
        ident = (d.device, d.data_ptr(), tuple(d.shape), d.stride(), d.dtype, st.global_offset, st.local_shape,
                 st.global_shape, (fr.start, fr.stop) if fr is not None else None)
        seen.setdefault(ident, []).append(i)
    ties: Dict[int, str] = {}
    for same in seen.values():
        if len(same) < 2:
            continue
        first = min(tensors[i].key for i in same)
        for i in same:
            if tensors[i].key != first:
                ties[i] = first
    return ties


def mark_ties(tensors: Sequence["ShardedTensor"], records: "RankRecords") -> "RankRecords":
    """``records`` with each tensor record's ``tie`` set (``ShardRecord`` is frozen: set as its ``of`` sets
    its fields)."""
    for i, key in local_ties(tensors).items():
        records.tensors[i].__dict__["tie"] = key
    return records


def decide_aliases(groups: Sequence["RecordGroup"], even_keys: Iterable[str]) -> Dict[str, str]:
    """alias -> target: the keys tied on every rank holding them, to the same target, with one global
    shape and dtype (the records carry each rank's tie, ``ShardRecord.tie``), both split evenly
    (``planning/even.py``) or neither."""
    if not any(getattr(r, "tie", None) for g in groups for r in g.records.tensors):
        return {}  # no record tied (most saves): nothing to decide
    even = set(even_keys)
    said: Dict[str, Optional[str]] = {}
    kind: Dict[str, Tuple[Any, ...]] = {}
    for g in groups:
        for r in g.records.tensors:
            kind.setdefault(r.key, (r.global_shape, r.dtype))
            tie = getattr(r, "tie", None)
            if r.key not in said:
                said[r.key] = tie
            elif said[r.key] != tie:
                said[r.key] = None  # ranks (or shards) disagree: written as before
    aliases = {}
    for key, target in said.items():
        if target is None or (key in even) != (target in even) or said.get(target) is not None:
            continue
        if target in kind and kind[target] == kind[key]:
            aliases[key] = target
    return aliases


def aliases_to_json(aliases: Dict[str, str], tensors: Dict[str, "TensorEntry"]) -> Dict[str, Any]:
    """``metadata.json``'s ``aliases``: each alias's target, global shape and dtype (checked on read)."""
    return {b: {"target": a, "global_shape": list(tensors[a].global_shape), "dtype": tensors[a].dtype}
            for b, a in sorted(aliases.items())}


def parse_aliases(data: Any, tensors: Dict[str, "TensorEntry"], objects: Dict[str, Any],
                  where: str) -> Dict[str, str]:
    """Check ``metadata.json``'s ``aliases`` against the stored tensors and serve each alias from its
    target (its entry put under the alias's key). FormatError: an alias naming no stored tensor, one
    naming an alias (a chain or a cycle), a key both stored and an alias, shape or dtype disagreeing."""
    if not isinstance(data, dict):
        raise FormatError(f"{where}: metadata.json field aliases must be an object, got {type(data).__name__}")
    out: Dict[str, str] = {}
    for key, e in data.items():
        name = f"aliases[{quoted(key)}]"
        if not isinstance(key, str) or not key or not isinstance(e, dict):
            raise FormatError(f"{where}: metadata.json field {name} must be a non-empty key naming an object")
        target = e.get("target")
        if not isinstance(target, str) or target not in tensors:
            why = "another alias (a chain or a cycle)" if isinstance(target, str) and target in data else \
                "no stored tensor"
            raise FormatError(f"{where}: metadata.json field {name}.target {quoted(target)} names {why}")
        if key in tensors or key in objects:
            raise FormatError(f"{where}: metadata.json field {name}: {quoted(key)} is also stored")
        entry = tensors[target]
        if e.get("global_shape") != list(entry.global_shape) or e.get("dtype") != entry.dtype:
            raise FormatError(f"{where}: metadata.json field {name} says {e.get('dtype')!r} of shape "
                              f"{e.get('global_shape')!r}, but its target {quoted(target)} is stored as "
                              f"{entry.dtype!r} of shape {list(entry.global_shape)}")
        out[key] = target
    per_target = Counter(out.values())
    crowded = [t for t, n in per_target.items() if n > MAX_ALIASES_PER_TARGET]
    if crowded:
        raise FormatError(f"{where}: metadata.json field aliases names {quoted(crowded[0])} "
                          f"{per_target[crowded[0]]} times (at most {MAX_ALIASES_PER_TARGET}: no tie is that wide)")
    for key, target in out.items():
        tensors[key] = tensors[target]  # the same entry: read from the target's stored shards
    return out
