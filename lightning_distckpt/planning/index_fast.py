"""The common case of ``metadata.json``'s tensor entries, checked and built in one tight pass.

``CheckpointIndex.from_json`` checks every field of every entry and names the field that is wrong;
building those names (``tensors['k'].shards[0].offset``) and calling one checker per field cost
more than the records themselves (10,000 tiny tensors: ~4 µs an entry). Here the same checks run
inline on the entries as we write them (an even split, or listed shards without flat ranges), and
nothing is named: an entry that fails any check, or is of another kind, is left out, and the full
parse checks it again and raises the FormatError naming the field. So this accepts a subset of
what the full parse accepts, building the same records. Also the index-wide check that no two keys
share a storage path.
"""

from __future__ import annotations

import math
from typing import Any, Dict, Optional

from ..core.errors import FormatError
from ..storage.key_paths import colliding_keys, collision_reason
from .even_index import MAX_OVER, EvenSplit, chunks_bound

_MAX_DIM = 1 << 62  # as metadata._Fields.shape
_MAX_NDIM = 32
_MAX_COUNT = 1 << 31  # as metadata._Fields.count (writers, indices)


def _dims(v: Any, ndim: Optional[int] = None) -> Optional[tuple]:
    """``v`` as a shape tuple where it is a list of at most 32 ints in [0, 2**62) (of ``ndim`` of them
    where given); else None."""
    if type(v) is not list or len(v) > _MAX_NDIM or (ndim is not None and len(v) != ndim):
        return None
    for i in v:
        if type(i) is not int or not 0 <= i < _MAX_DIM:
            return None
    return tuple(v)


def fast_tensor_entries(tensors: Dict[Any, Any], even_ok: bool, world_size: Any, rank_stores: Optional[int],
                        max_bytes: int) -> Dict[str, Any]:
    """key -> TensorEntry of the entries of ``tensors`` (metadata.json's, checked to be an object)
    that pass every check of the full parse; the others are left out (the full parse names their
    fault). ``even_ok``: the format has even splits."""
    from .metadata import _DTYPES, StoredShard, TensorEntry  # metadata imports this module

    sizes = {name: dt.itemsize for name, dt in _DTYPES.items()}
    most = MAX_OVER if type(world_size) is not int or world_size < 1 else min(world_size, MAX_OVER)
    bound = chunks_bound(rank_stores) if rank_stores is not None else None
    out: Dict[str, Any] = {}
    for key, e in tensors.items():
        if type(key) is not str or not key or type(e) is not dict:
            continue
        dtype = e.get("dtype")
        size = sizes.get(dtype) if type(dtype) is str else None
        gshape = _dims(e.get("global_shape"))
        if size is None or gshape is None or math.prod(gshape) * size > max_bytes:
            continue
        if "even" in e:
            even = e["even"]
            if not even_ok or "shards" in e or type(even) is not dict or not gshape:
                continue
            over, first = even.get("over"), even.get("packed_from")
            if type(over) is not int or not 1 <= over <= most:
                continue
            rows = -(-gshape[0] // over)
            n = -(-gshape[0] // rows) if rows else 0  # chunks_count
            if (bound is not None and n > bound) or type(first) is not int or not 0 <= first <= n:
                continue
            out[key] = TensorEntry(gshape, dtype, even=EvenSplit(over, first))
            continue
        shards = _listed(e.get("shards"), gshape, StoredShard)
        if shards is not None:
            out[key] = TensorEntry(gshape, dtype, shards)
    return out


def _listed(listed: Any, gshape: tuple, shard_cls: Any) -> Optional[list]:
    """The StoredShards of an entry's ``shards`` where each is a plain one (no flat range) that
    passes the full parse's checks; else None."""
    if type(listed) is not list:
        return None
    ndim, shards = len(gshape), []
    for s in listed:
        if type(s) is not dict or s.get("flat") is not None:
            return None
        offset, shape = _dims(s.get("offset"), ndim), _dims(s.get("shape"), ndim)
        if offset is None or shape is None:
            return None
        for o, n, g in zip(offset, shape, gshape):
            if o + n > g:
                return None
        writer, index, packed = s.get("writer"), s.get("index"), s.get("packed")
        if type(writer) is not int or type(index) is not int or not (0 <= writer < _MAX_COUNT and
                                                                      0 <= index < _MAX_COUNT):
            return None
        if packed is not None and (type(packed) is not int or not 0 <= packed < _MAX_DIM):
            return None
        shards.append(shard_cls(offset, shape, None, writer, index, packed))
    return shards


def refuse_colliding_keys(index: Any, where: str) -> None:
    """FormatError when two tensor keys, or two object keys, are stored at one path (a save
    refuses them: ``storage/key_paths.py``), so neither is read as the other."""
    for kind, keys in (("tensors", index.tensors), ("objects", index.objects)):
        for a, b in colliding_keys(keys):
            raise FormatError(f"{where}: metadata.json lists {kind} {a!r} and {b!r}: {collision_reason(a, b)}; a save "
                              f"refuses them, so this index was not written by us")
