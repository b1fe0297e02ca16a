"""Packed small shards: one 1-D array per writing rank and dtype holds the small shards (norms,
biases) of that rank back to back; each shard's element offset is in ``metadata.json``. How a pack
is built for writing and how a packed shard is seen when reading."""

from __future__ import annotations

import math
from typing import Any, Sequence, Tuple

import ml_dtypes
import numpy as np
import tensorstore as ts
import torch

from .base import ShardWrite


def build_pack(dtype: torch.dtype, members: Sequence[ShardWrite]) -> torch.Tensor:
    """One 1-D tensor holding every member's data at its planned element offset."""
    end = max(w.packed + w.data.numel() for w in members)  # type: ignore[operator]
    buf = torch.empty(end, dtype=dtype)
    for w in members:
        buf[w.packed:w.packed + w.data.numel()] = w.data.reshape(-1)  # type: ignore[operator]
    return buf


def as_tensor(arr: np.ndarray) -> torch.Tensor:
    """A torch view of a numpy array read from a store (bfloat16 included)."""
    if arr.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(arr)


def packed_view(pack: Any, offset: int, shape: Tuple[int, ...]) -> Any:
    """A read view of ``prod(shape)`` elements of the 1-D ``pack`` from ``offset``, in ``shape``:
    element ``i`` (row-major) of the view is ``pack[offset + i]``. Reads past the pack's end fail."""
    numel = math.prod(shape)
    if not shape:
        return pack[offset]
    if len(shape) == 1:
        return pack[offset:offset + numel].translate_to[0]
    positions = np.arange(offset, offset + numel, dtype=np.int64).reshape(shape)
    return pack[ts.IndexTransform(input_shape=shape, output=[ts.OutputIndexMap(index_array=positions)])]
