"""Plain tensors saved by tree path (``core/plain_tensors.py``), on load: where the template holds
none, and where a checkpoint written before holds them in its common state.

* :func:`stored_places`: ``metadata.json``'s ``plain_tensors`` (each plain tensor's key and steps),
  checked (the file is not trusted). A load reads each one whose place the template leaves free
  whole into a new CPU tensor put at that place (:func:`request_stored`), so what comes back is what
  the common state gave back before: the saved tree, tensors included, under the template's leaves.
* :func:`fill_from_common`: a template's plain tensor whose key the checkpoint lacks (written before
  plain tensors were stored as tensors, or by a writer that keeps them in its common state) is
  filled from the common state's tensor at its place, copied into the template's tensor; such a key
  is not "unexpected".
"""

from __future__ import annotations

from typing import Any, Dict, List, Sequence

import torch

from ..core.errors import FormatError, ShardingError
from ..core.mapping import ShardedTensor
from ..core.tree_paths import MISSING, Steps, free_place, put_at, show, steps_from_json, value_at
from ..planning.coverage import describe_rows, uncovered_rows
from ..planning.load_plan import check_dtype_conversion
from ..planning.metadata import TensorEntry, dtype_name
from .reads import read_tensors
from .request import LoadRequest, TensorSlot, assemble

FIELD = "plain_tensors"  # metadata.json: key -> steps of each plain tensor leaf
MAX_LIST_INDEX = 1 << 24  # a list position in a stored path (real lists of tensors hold thousands)
MAX_PADDING = 1 << 22  # list slots a load may pad with None to put stored tensors back


def stored_places(source: Any) -> Dict[str, Steps]:
    """key -> steps of each plain tensor ``source`` stored by tree path (none for a checkpoint
    written before, or a source of another format). FormatError naming the field when it is damaged."""
    meta = getattr(source, "meta", None)
    if not isinstance(meta, dict) or FIELD not in meta:
        return {}
    where = f"checkpoint {source.path}: metadata.json field {FIELD}"
    raw = meta[FIELD]
    if not isinstance(raw, dict):
        raise FormatError(f"{where} must be an object, got {str(raw)[:80]}")
    out = {}
    for key, steps in raw.items():
        if key not in source.index.tensors:
            raise FormatError(f"{where}[{key!r}] names a tensor its index does not list")
        out[key] = steps_from_json(steps, key, where, MAX_LIST_INDEX)
    return out


def request_stored(request: LoadRequest, source: Any, stored: Dict[str, Steps]) -> None:
    """Add to ``request`` each stored plain tensor whose place its tree leaves free (no template
    leaf there): read whole into a new CPU tensor, its slot put at that place."""
    padded = 0
    for key, steps in stored.items():
        depth = free_place(request.tree, steps)
        if depth is None:  # the template holds that place: its own leaf decides what is read there
            continue
        entry = source.index.tensors[key]
        gaps = uncovered_rows(entry)
        if gaps:  # a whole tensor is allocated by its claimed shape: the claim must be stored
            raise FormatError(f"checkpoint {source.path}: plain tensor {key!r} of global shape "
                              f"{list(entry.global_shape)}: {describe_rows(gaps)} are not stored")
        shape = tuple(entry.global_shape)
        dtype = entry.torch_dtype
        request.tensors.append(ShardedTensor(key=key, data=torch.empty(shape, dtype=dtype), dtype=dtype,
                                             local_shape=shape, global_shape=shape, global_offset=(0,) * len(shape)))
        padded += put_at(request.tree, steps, TensorSlot(len(request.tensors) - 1), depth)
        if padded > MAX_PADDING:
            raise FormatError(f"checkpoint {source.path}: metadata.json field {FIELD} puts tensors at list positions "
                              f"needing more than {MAX_PADDING} empty slots before them; not written by us")


def lacking_plain(request: LoadRequest, source: Any) -> Dict[int, Steps]:
    """position -> steps of each template plain tensor whose key the checkpoint does not store."""
    return {pos: steps for pos, steps in request.plain.items() if request.tensors[pos].key not in source.index.tensors}


def fill_from_common(request: LoadRequest, source: Any, lacking: Dict[int, Steps], common: Any,
                     cast: str) -> Dict[int, torch.Tensor]:
    """position -> the common state's tensor at the place of each of ``lacking`` (the template's
    plain tensors the checkpoint has no key for), to be copied into the template's tensor. A place
    holding nothing is left out (its key is unexpected, as for any other); one holding a value the
    template's tensor cannot take (another shape, not a tensor, a dtype across kinds without
    ``cast="any"``) is a ShardingError naming the key."""
    out = {}
    for pos, steps in lacking.items():
        value = value_at(common, steps)
        if value is MISSING:
            continue
        st = request.tensors[pos]
        held = f"a value of type {type(value).__name__}"
        if isinstance(value, torch.Tensor):
            held = f"a tensor of shape {tuple(value.shape)}"
            if tuple(value.shape) == tuple(st.global_shape):
                entry = TensorEntry(tuple(value.shape), dtype_name(value.dtype, st.key))
                check_dtype_conversion(st, entry, source.path, cast)
                out[pos] = value
                continue
        raise ShardingError(
            f"checkpoint {source.path}: {st.key!r} is not among its tensors, and its common state (kept there by a "
            f"save before plain tensors were stored as tensors) holds {held} at {show(steps)}, where the template "
            f"has a tensor of shape {tuple(st.global_shape)}")
    return out


def with_filled(tensors: Sequence[Any], filled: Dict[int, torch.Tensor]) -> List[Any]:
    """The loaders' results with the common state's tensors at their positions (each is copied into
    its template tensor when the factories are merged back)."""
    out = list(tensors)
    for pos, value in filled.items():
        if pos < len(out):
            out[pos] = value
    return out


def common_with_plain_tensors(source: Any, extra_safe_globals: Sequence[Any] = ()) -> Any:
    """``source``'s common state with its stored plain tensors read whole (this process alone) and
    put back at their places: what a load with an empty template returns."""
    common = source.load_common(extra_safe_globals)
    stored = stored_places(source)
    if not stored:
        return common
    request = LoadRequest({}, [], [])
    request_stored(request, source, stored)
    loaded, _ = read_tensors(source, request.tensors, set())
    return assemble(request, common, loaded, [])
