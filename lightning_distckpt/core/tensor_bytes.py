"""A tensor's bytes as a flat uint8 tensor, for code that moves or checksums bytes whatever the dtype."""

from __future__ import annotations

import numpy as np
import torch


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor (no copy): collectives and checksums move bytes, so
    any dtype goes over any backend."""
    # Not t.reshape(-1): torch calls a tensor contiguous whatever the strides of its size-1 axes
    # (one element, stride 2: a view of every other element), reshape keeps such a stride and
    # view(uint8) refuses it. Contiguous, the elements are numel() consecutive ones from the offset.
    return t.as_strided((t.numel(),), (1,)).view(torch.uint8)


class _Borrowed:
    """What a :func:`numpy_view` borrows: the tensor (kept alive as the array's ``base``) and where its
    elements are, as numpy's array interface describes them."""

    __slots__ = ("__array_interface__", "tensor")


_NUMPY_DTYPES: "dict[torch.dtype, np.dtype]" = {}


def numpy_view(t: torch.Tensor) -> np.ndarray:
    """A numpy array sharing ``t``'s memory (a CPU tensor of a dtype numpy has), as ``t.numpy()`` but
    leaving ``t``'s storage resizable: ``Tensor.numpy()`` marks it not resizable for good (so that the
    array cannot dangle), and a save or load must not change what a user may do with their tensors
    afterwards (``resize_``, ``set_``, FSDP freeing storage). The array is for the moment of a copy;
    resizing ``t`` while it is used would leave it pointing at freed memory."""
    if t.is_conj() or t.is_neg() or t.device.type != "cpu":
        return t.numpy()  # refused with torch's own message (a lazy bit must be resolved first)
    dtype = _NUMPY_DTYPES.get(t.dtype)
    if dtype is None:
        dtype = _NUMPY_DTYPES.setdefault(t.dtype, torch.empty(0, dtype=t.dtype).numpy().dtype)
    if t.numel() == 0:
        return np.empty(tuple(t.shape), dtype)
    size = dtype.itemsize
    borrowed = _Borrowed()
    borrowed.tensor = t
    borrowed.__array_interface__ = {"data": (t.data_ptr(), False), "shape": tuple(t.shape), "typestr": dtype.str,
                                    "strides": tuple(s * size for s in t.stride()), "version": 3}
    return np.asarray(borrowed)
