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


def tie_groups(tensors: Sequence[ShardedTensor], data_ids: Sequence[Optional[int]]) -> List[List[int]]:
    """Positions of the template's tensors that share one tensor (``data_ids``: ``id`` of each
    template tensor's ``data`` as given, before meta tensors were dropped; None for none), groups of 2+."""
    groups: Dict[tuple, List[int]] = {}
    for pos, ident in enumerate(data_ids):
        if ident is not None and pos < len(tensors):
            t = tensors[pos]  # the same part of one tensor: a buffer cut into parts under several keys is no tie
            fr = t.flattened_range  # a slice: unhashable before Python 3.12
            flat = None if fr is None else (fr.start, fr.stop, fr.step)
            part = (ident, tuple(t.global_shape), tuple(t.global_offset), tuple(t.local_shape), flat)
            groups.setdefault(part, []).append(pos)
    return [g for g in groups.values() if len({tensors[p].key for p in g}) > 1]


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
            other = values[p]
            if (other.dtype != first.dtype or other.shape != first.shape
                    or not torch.equal(other.to(first.device), first)):
                raise ValidationError(
                    f"{where}: {tensors[read[0]].key!r} and {tensors[p].key!r} are one tensor in the template (tied "
                    f"weights) but the checkpoint holds different values for them; untie them in the module, or "
                    f"drop one of the two keys from the checkpoint or the template")
        for p in g:
            values[p] = first
