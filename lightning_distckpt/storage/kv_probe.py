"""Asking a tensorstore kvstore whether a value holds more than N bytes, without reading it.

A kvstore lists no sizes (an S3 listing through tensorstore carries none; an OCDBT value may name any
range of its data file), and a read without a byte range fetches the value whole, however large. So
the byte just past N is read alone: tensorstore answers ``OUT_OF_RANGE`` when the value ends before it,
and a value holding it is larger than N. Every bounded read (zarr.json, OCDBT-stored objects, S3
objects) asks this way.
"""

from __future__ import annotations

from typing import Any, Optional


def read_past(kvstore: Any, key: Any, limit: int) -> Any:
    """The read future of byte ``limit`` of ``key`` alone (the first byte past ``limit`` bytes)."""
    return kvstore.read(key, byte_range=slice(limit, limit + 1))


def ends_before(error: Optional[BaseException]) -> bool:
    """Whether a failed ranged read says the value ends before the range (tensorstore's
    ``OUT_OF_RANGE``): for :func:`read_past`, the value holds at most ``limit`` bytes."""
    return error is not None and "OUT_OF_RANGE" in str(error)


def holds_byte(result: Any) -> bool:
    """Whether a successful :func:`read_past` found the byte: the value is larger than ``limit``
    (a missing value, or an empty answer, holds none)."""
    return result.state == "value" and len(result.value) > 0
