"""Tied tensors in a load template: one tensor of the module under several keys (a tied embedding).

Hugging Face saves such a tensor once (``lm_head.weight`` left out for ``model.embed_tokens.weight``);
safetensors' ``load_model`` and ``from_pretrained`` fill the other name from it. A load does the same:
a key the checkpoint lacks is not "unexpected" when a key tied to it is stored, and takes that key's
value. A checkpoint storing several tied keys with different values is refused: one tensor cannot
hold both, and which one the last read left in it would be an accident of read order.
"""

from __future__ import annotations

import dataclasses
from typing import AbstractSet, Dict, List, Optional, Sequence

import torch

from ..core.errors import ValidationError
from ..core.mapping import ShardedTensor


def tie_groups(tensors: Sequence[ShardedTensor],
               data_ids: Optional[Sequence[Optional[int]]] = None) -> List[List[int]]:
    """Positions of the template's tensors that hold the same part of one tensor under several keys, groups of
    2+ (a buffer cut into parts under several keys is no tie). ``data_ids``: ``id`` of each tensor's ``data``
    as the caller had it (before meta tensors were dropped; None for none); by default their ``data`` now."""
    ids = data_ids if data_ids is not None else [id(t.data) if isinstance(t.data, torch.Tensor) else None
                                                 for t in tensors]
    held = [i for i in ids[:len(tensors)] if i is not None]
    if len(set(held)) == len(held):  # no tensor under two keys (almost every template): no list per position
        return []
    by_id: Dict[int, List[int]] = {}
    for pos, ident in enumerate(ids):
        if ident is not None and pos < len(tensors):
            by_id.setdefault(ident, []).append(pos)
    out: List[List[int]] = []
    for shared in by_id.values():  # almost always one position each: the parts compared only where shared
        if len(shared) < 2:
            continue
        parts: Dict[tuple, List[int]] = {}
        for p in shared:
            parts.setdefault(_part(tensors[p]), []).append(p)
        out += [g for g in parts.values() if len({tensors[p].key for p in g}) > 1]
    return out


def _part(t: ShardedTensor) -> tuple:
    fr = t.flattened_range  # a slice: unhashable before Python 3.12
    flat = None if fr is None else (fr.start, fr.stop, fr.step)
    return tuple(t.global_shape), tuple(t.global_offset), tuple(t.local_shape), flat


def same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two values given for one tied tensor agree (dtype, shape and every element)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(b.to(a.device), a)


def tied_to_stored(tensors: Sequence[ShardedTensor], groups: Sequence[List[int]],
                   stored: AbstractSet[str]) -> AbstractSet[str]:
    """Keys the checkpoint lacks whose tied twin it stores (filled from it, not unexpected)."""
    out = set()
    for g in groups:
        if any(tensors[p].key in stored for p in g):
            out |= {tensors[p].key for p in g if tensors[p].key not in stored}
    return out


def untie_reads(tensors: List[ShardedTensor], groups: Sequence[List[int]], absent: AbstractSet[str]) -> None:
    """Where a group has several stored keys, the first reads into the shared tensor and the others into
    fresh tensors of their own (compared in :func:`tie_results`); in place in ``tensors``."""
    for g in groups:
        read = [p for p in g if tensors[p].key not in absent]
        for p in read[1:]:
            st = tensors[p]
            dtype = st.data.dtype if isinstance(st.data, torch.Tensor) else st.dtype
            tensors[p] = dataclasses.replace(st, data=None, dtype=dtype)


def tie_results(tensors: Sequence[ShardedTensor], groups: Sequence[List[int]], values: List[Optional[torch.Tensor]],
                absent: AbstractSet[str], where: str) -> None:
    """Every position of a group gets the value of its first stored key (in place in ``values``), so the
    tie is kept; ValidationError where another stored key of the group holds a different value."""
    for g in groups:
        read = [p for p in g if tensors[p].key not in absent and values[p] is not None]
        if not read:
            continue
        first = values[read[0]]
        for p in read[1:]:
            if not same_values(first, values[p]):
                raise ValidationError(
                    f"{where}: {tensors[read[0]].key!r} and {tensors[p].key!r} are one tensor in the template (tied "
                    f"weights) but the checkpoint holds different values for them; untie them in the module, or "
                    f"drop one of the two keys from the checkpoint or the template")
        for p in g:
            values[p] = first
