"""Buckets of small chunks as one message: their bytes gathered back to back into the bucket's
buffer by its reader, and scattered out of it by each receiver. On the CPU by a raw memmove between
the tensors' own memory (well under 1 µs a chunk, where a numpy view costs ~2 and torch's slicing,
view and copy 5-10: thousands of norms and biases per load), for a tensor whose bytes are plainly
its values (contiguous, no lazy conjugate or negative bit) and are exactly the chunk's size; else by
numpy; elsewhere (a GPU buffer, a dtype numpy does not hold) by torch."""

from __future__ import annotations

import ctypes
from typing import List, Optional, Sequence

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


def raw_addresses(buf: torch.Tensor, tensors: Sequence[torch.Tensor], sizes: Sequence[int]) -> List[int]:
    """The data address of each of ``tensors`` whose ``sizes`` bytes may be moved raw to or from ``buf``: a
    contiguous CPU tensor of a dtype numpy holds, with no lazy conjugate or negative bit (its memory is not its
    values then), of exactly that many bytes; 0 for one that may not (moved by :func:`_np_bytes` or torch). All
    0 where ``buf`` is not a contiguous CPU uint8 tensor of at least ``sum(sizes)`` bytes."""
    if not (buf.is_cpu and buf.dtype == torch.uint8 and buf.is_contiguous() and sum(sizes) <= buf.numel()):
        return [0] * len(sizes)
    out = []
    for t, n in zip(tensors, sizes):
        ok = (t.is_cpu and t.dtype in _NUMPY_DTYPES and t.is_contiguous() and not t.is_conj() and not t.is_neg()
              and t.numel() * t.element_size() == n and n > 0)
        out.append(t.data_ptr() if ok else 0)
    return out


def gather_bytes(buf: torch.Tensor, tensors: Sequence[torch.Tensor], sizes: Sequence[int]) -> None:
    """The bytes of ``tensors`` back to back into the uint8 ``buf`` (a bucket of chunks)."""
    out, o = (buf.numpy() if buf.device.type == "cpu" else None), 0
    base = buf.data_ptr() if out is not None else 0
    for t, n, addr in zip(tensors, sizes, raw_addresses(buf, tensors, sizes)):
        if addr:
            ctypes.memmove(base + o, addr, n)
            o += n
            continue
        src = _np_bytes(t) if out is not None else None
        if src is not None:
            out[o:o + n] = src
        else:
            buf[o:o + n].copy_(byte_view(t))
        o += n


def scatter_bytes(buf: torch.Tensor, tensors: Sequence[torch.Tensor], sizes: Sequence[int]) -> None:
    """:func:`gather_bytes` backwards: each of ``tensors`` gets its bytes out of ``buf``."""
    data, o = (buf.numpy() if buf.device.type == "cpu" else None), 0
    base = buf.data_ptr() if data is not None else 0
    for d, n, addr in zip(tensors, sizes, raw_addresses(buf, tensors, sizes)):
        if addr:
            ctypes.memmove(addr, base + o, n)
            o += n
            continue
        dst = _np_bytes(d) if data is not None else None
        if dst is not None:
            dst[:] = data[o:o + n]
        elif d.is_contiguous():
            byte_view(d).copy_(buf[o:o + n])
        else:  # a bucket offset need not be aligned for a view as d.dtype: then a clone (a chunk alone is at 0)
            piece = buf[o:o + n] if o % d.element_size() == 0 else buf[o:o + n].clone()
            d.copy_(piece.view(d.dtype).view(d.shape))
        o += n
