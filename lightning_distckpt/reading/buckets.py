"""Buckets of small chunks as one message: their bytes gathered back to back into the bucket's
buffer by its reader, and scattered out of it by each receiver. On the CPU by numpy (about 1 µs a
chunk, where torch's slicing, view and copy cost 5-10: thousands of norms and biases per load);
elsewhere (a GPU buffer, a dtype numpy does not hold) by torch."""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch

from ..core.tensor_bytes import byte_view
from ..storage.packs import to_numpy


# dtypes numpy holds as they are (bfloat16 and float8 through ml_dtypes): small chunks move by numpy, ~1 µs each
_NUMPY_DTYPES = {torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
                 torch.int8, torch.uint8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz,
                 torch.float8_e5m2fnuz, torch.uint16, torch.uint32, torch.uint64, torch.complex64, torch.complex128}


def _np_bytes(t: torch.Tensor) -> Optional[np.ndarray]:
    """A flat uint8 numpy view of a contiguous CPU tensor, or None where torch must copy it."""
    if t.device.type != "cpu" or t.dtype not in _NUMPY_DTYPES or not t.is_contiguous():
        return None
    return to_numpy(t).reshape(-1).view(np.uint8)


def gather_bytes(buf: torch.Tensor, tensors: Sequence[torch.Tensor], sizes: Sequence[int]) -> None:
    """The bytes of ``tensors`` back to back into the uint8 ``buf`` (a bucket of chunks)."""
    out, o = (buf.numpy() if buf.device.type == "cpu" else None), 0
    for t, n in zip(tensors, sizes):
        src = _np_bytes(t) if out is not None else None
        if src is not None:
            out[o:o + n] = src
        else:
            buf[o:o + n].copy_(byte_view(t))
        o += n


def scatter_bytes(buf: torch.Tensor, tensors: Sequence[torch.Tensor], sizes: Sequence[int]) -> None:
    """:func:`gather_bytes` backwards: each of ``tensors`` gets its bytes out of ``buf``."""
    data, o = (buf.numpy() if buf.device.type == "cpu" else None), 0
    for d, n in zip(tensors, sizes):
        dst = _np_bytes(d) if data is not None else None
        if dst is not None:
            dst[:] = data[o:o + n]
        elif d.is_contiguous():
            byte_view(d).copy_(buf[o:o + n])
        else:  # a bucket offset need not be aligned for a view as d.dtype: then a clone (a chunk alone is at 0)
            piece = buf[o:o + n] if o % d.element_size() == 0 else buf[o:o + n].clone()
            d.copy_(piece.view(d.dtype).view(d.shape))
        o += n
