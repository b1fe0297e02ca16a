"""The zarr metadata of our arrays: their chunking and dtype names when a save creates them, and the
zarr.json a reader reads itself to open them.

A reader needs each array's metadata as data (its chunk checksums, codecs and chunk key encoding).
tensorstore's ``Spec.to_json()`` would give it, but (tensorstore 0.1.86) it leaves one reference
on every nested list and dict it returns, about a dozen objects per array and so thousands per
load that are never freed, and it costs about 90 µs per array. Instead the reader reads each
``zarr.json`` through the store (about 20 µs, concurrently), parses it as untrusted data, and
opens the array with it (``assume_metadata``): tensorstore checks it as it builds the array and
does not read it a second time.
"""

from __future__ import annotations

import json
import math
from typing import Any, Dict, List, Optional, Sequence

import torch

from ..core.errors import FormatError


def chunk_shape(shape: Sequence[int], itemsize: int, chunk_bytes: int) -> List[int]:
    """Whole trailing axes, the first axis cut into as few chunks as hold at most ``chunk_bytes``
    each (or one row, if a row is bigger), as even as they go: zarr stores the last chunk whole, so
    an 86 MiB tensor cut at 64 MiB would store 128 MiB; cut in two halves it stores 86."""
    shape = [max(1, int(s)) for s in shape]
    if not shape:
        return []
    row = math.prod(shape[1:]) * itemsize
    count = -(-shape[0] // max(1, chunk_bytes // max(1, row)))
    return [-(-shape[0] // count)] + shape[1:]


def ts_dtype(dtype: torch.dtype) -> str:
    """tensorstore / zarr v3 name of a torch dtype (``torch.bfloat16`` -> ``"bfloat16"``)."""
    return str(dtype).replace("torch.", "")


def metadata_key(array_path: str) -> str:
    """The store key of the zarr.json of the array at ``array_path``."""
    return array_path.rstrip("/") + "/zarr.json"


def parse_metadata(read_result: Any, where: str) -> Optional[Dict[str, Any]]:
    """The metadata in a kvstore read of a zarr.json, None when it is missing. FormatError when it
    is not a JSON object (bad bytes, bad JSON, nesting too deep)."""
    if read_result.state != "value":
        return None
    try:
        metadata = json.loads(bytes(read_result.value))
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise FormatError(f"{where}: its zarr.json is not valid JSON ({type(e).__name__}): damaged") from e
    if not isinstance(metadata, dict):
        raise FormatError(f"{where}: its zarr.json is not a JSON object: damaged")
    return metadata


def open_spec(array_spec: Dict[str, Any], metadata: Dict[str, Any]) -> Dict[str, Any]:
    """``array_spec`` (opening an array for reading) given the metadata read from its zarr.json."""
    return {**array_spec, "metadata": metadata}
