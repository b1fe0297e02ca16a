"""The dtypes a checkpoint stores, by the names ``metadata.json`` gives them, and their kinds.

Each is stored natively: the zarr v3 / tensorstore data type of the same name (bfloat16 and the
float8 types are ml_dtypes' types in numpy), so every stored array is plain bytes of its dtype.
"""

from __future__ import annotations

from typing import Dict

import torch

from ..core.errors import FormatError, ShardingError

_DTYPES: Dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "float64": torch.float64,
    "int8": torch.int8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "uint8": torch.uint8,
    "bool": torch.bool,
    # Added after release 0.3.0, in the same format version: a reader of 0.3.0 or earlier refuses an index
    # naming one of these (a FormatError naming the field and the dtype) before it reads anything, and
    # still reads every checkpoint that holds none of them (docs/format.md, "Dtypes").
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "float8_e4m3fnuz": torch.float8_e4m3fnuz,
    "float8_e5m2fnuz": torch.float8_e5m2fnuz,
    "uint16": torch.uint16,
    "uint32": torch.uint32,
    "uint64": torch.uint64,
    "complex64": torch.complex64,
    "complex128": torch.complex128,
}
_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}


def dtype_name(dtype: torch.dtype, key: str = "?") -> str:
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise ShardingError(f"{key!r}: dtype {dtype} is not supported; supported: {sorted(_DTYPES)}") from None


def dtype_from_name(name: str, key: str = "?") -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise FormatError(f"{key!r}: unknown dtype {name!r} in checkpoint metadata") from None


def element_size(name: str) -> int:
    return _DTYPES[name].itemsize  # no tensor allocation: planning calls this per shard record


def dtype_kind(dtype: torch.dtype) -> str:
    """``"bool"``, ``"floating"`` (float8 included), ``"complex"`` or ``"integer"`` (unsigned included):
    loads convert within a kind; across kinds only when asked (``cast="any"``), and never from complex
    to a real dtype (``Tensor.copy_`` would keep only the real parts)."""
    if dtype == torch.bool:
        return "bool"
    if dtype.is_complex:
        return "complex"
    return "floating" if dtype.is_floating_point else "integer"
