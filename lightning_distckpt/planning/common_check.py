"""Does every rank hold the same common (non-sharded) state?

Only one copy of the common state is saved (rank 0's), so a value that differs on another rank
would be dropped without a word: a per-stage counter under pipeline parallelism, a rank-dependent
setting. Ranks exchange digests, never the state itself: one digest of the whole state on every
save, and per-leaf digests only when the whole digests disagree. Pure functions, no collectives.

A digest is of the state pickled as it is in memory, each plain tensor by its type, dtype, shape,
``requires_grad`` and its value (one element) or a hash of its bytes (:func:`common_digest`), not of
``torch.save``'s archive: that writes a record per tensor (a Lightning checkpoint's common state
holds an optimizer ``step`` tensor per parameter: ~3.8 ms for 147 of them, against ~0.3 ms), and
only rank 0's archive is saved, so the other ranks call no ``torch.save`` at all (Lightning's own
tests count its calls per rank). A value pickle cannot serialize fails the digest on every rank alike.
"""

from __future__ import annotations

import copyreg
import hashlib
import io
import pickle
from typing import Any, Dict, Iterable, List, NamedTuple, Sequence, Tuple

import torch

from ..core.state_dict import iter_leaves
from ..core.tensor_bytes import numpy_view


def digest(data: Any) -> str:
    """A short content digest (not a security hash: it only compares ranks' own bytes)."""
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def leaf_path(path: Sequence[Any]) -> str:
    """``("optimizer", "param_groups", 0, "lr")`` -> ``"optimizer.param_groups.0.lr"``."""
    return ".".join(str(p) for p in path) or "<root>"


def _tensor_value(*fields: Any) -> Tuple[Any, ...]:
    """What a plain tensor pickles as in a digest (never unpickled: digests compare bytes)."""
    return fields


def _reduce_tensor(t: torch.Tensor) -> Any:
    if t.layout != torch.strided or t.is_meta or t.is_quantized:  # no plain bytes: as pickle does
        return t.__reduce_ex__(pickle.DEFAULT_PROTOCOL)
    if t.numel() == 1 and t.device.type == "cpu":  # an optimizer's step: its value (exact), no bytes to hash
        value: Any = t.item()
    else:
        data = t.detach().resolve_conj().resolve_neg().reshape(-1).contiguous().cpu()
        value = hashlib.blake2b(numpy_view(data.view(torch.uint8)) if data.numel() else b"", digest_size=16).digest()
    return _tensor_value, (type(t).__name__, str(t.dtype), tuple(t.shape), t.requires_grad, value)


_DISPATCH = dict(copyreg.dispatch_table)
_DISPATCH.update({torch.Tensor: _reduce_tensor, torch.nn.Parameter: _reduce_tensor})


def common_digest(value: Any) -> str:
    """A digest of ``value`` that ranks holding equal values agree on (see the module docstring);
    raises what pickle raises for a value it cannot serialize."""
    buf = io.BytesIO()
    pickler = pickle.Pickler(buf, protocol=pickle.DEFAULT_PROTOCOL)
    pickler.dispatch_table = _DISPATCH
    pickler.dump(value)
    return digest(buf.getbuffer())


def common_differences(per_rank: Sequence[Dict[str, str]], limit: int = 10) -> List[str]:
    """Where ranks' leaf digests disagree with rank 0's (whose copy is the one saved).

    Returns one line per differing path (at most ``limit``, then a count of the rest), naming
    the ranks: a value that differs, or a path that only some ranks have.
    """
    reference = per_rank[0]
    paths = sorted(set().union(*per_rank))
    lines: List[str] = []
    for path in paths:
        if path not in reference:
            holders = [rk for rk, leaves in enumerate(per_rank) if path in leaves]
            lines.append(f"{path!r}: not on rank 0, only on ranks {holders} (not saved)")
            continue
        missing = [rk for rk, leaves in enumerate(per_rank) if path not in leaves]
        differ = [rk for rk, leaves in enumerate(per_rank) if path in leaves and leaves[path] != reference[path]]
        if differ:
            lines.append(f"{path!r}: differs from rank 0's value on ranks {differ}")
        if missing:
            lines.append(f"{path!r}: missing on ranks {missing}")
    if len(lines) > limit:
        lines = lines[:limit] + [f"... and {len(lines) - limit} more"]
    return lines


class Leaf(NamedTuple):
    """What ranks exchange of one common-state leaf when their states differ: its digest, each key
    of its path as Python writes it (``("'optimizer'", "'param_groups'", "0", "'lr'")``) and its type."""

    digest: str
    keys: Tuple[str, ...]
    type: str


def leaf_records(common: Any) -> Dict[str, Leaf]:
    """:class:`Leaf` of every leaf of the common state, by dotted path."""
    return {leaf_path(path): Leaf(common_digest(leaf), tuple(repr(k) for k in path), repr(type(leaf)))
            for path, leaf in iter_leaves(common)}


def _written(keys: Tuple[str, ...]) -> str:
    """The tuple of keys as Python writes it: ``('rank',)``, ``('a', 0)``."""
    return f"({keys[0]},)" if len(keys) == 1 else f"({', '.join(keys)})"


def _first_missing(keys: Iterable[Tuple[str, ...]], present: Iterable[Tuple[str, ...]]) -> str:
    """Each of ``keys`` cut at its first prefix that no path of ``present`` has (Megatron-Core names
    the missing sub-tree, not each of its leaves), as Megatron-Core's log line writes the list."""
    prefixes = {path[:i] for path in present for i in range(1, len(path) + 1)}
    cut = {next((key[:i] for i in range(1, len(key) + 1) if key[:i] not in prefixes), key) for key in keys}
    return f"[{', '.join(_written(k) for k in sorted(cut))}]"


def rank_differences(per_rank: Sequence[Dict[str, Leaf]], rank: int) -> Tuple[str, str, str]:
    """Megatron-Core's three lists for ``rank`` against rank 0, as its log line writes them: the keys
    only rank 0 has, those only ``rank`` has, and ``(keys, rank 0's type, this rank's type)`` of the
    leaves both have with different values. All three empty (``"[]"``) when the states agree."""
    reference, mine = per_rank[0], per_rank[rank]
    only_rank0 = _first_missing((reference[p].keys for p in set(reference) - set(mine)),
                                (leaf.keys for leaf in mine.values()))
    only_mine = _first_missing((mine[p].keys for p in set(mine) - set(reference)),
                               (leaf.keys for leaf in reference.values()))
    mismatched = [f"({_written(reference[p].keys)}, {reference[p].type}, {mine[p].type})"
                  for p in sorted(set(mine) & set(reference)) if mine[p].digest != reference[p].digest]
    return only_rank0, only_mine, f"[{', '.join(mismatched)}]"
