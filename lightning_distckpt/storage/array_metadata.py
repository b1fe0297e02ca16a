"""The zarr metadata of our arrays: their chunking and dtype names when a save creates them, and the
zarr.json a reader reads itself to open them.

A reader needs each array's metadata as data (its chunk checksums, codecs and chunk key encoding).
tensorstore's ``Spec.to_json()`` would give it, but (tensorstore 0.1.86) it leaves one reference
on every nested list and dict it returns, about a dozen objects per array and so thousands per
load that are never freed, and it costs about 90 µs per array. Instead the reader reads each
``zarr.json`` through the store (about 20 µs, concurrently), parses it as untrusted data, and
opens the array with it (``assume_metadata``): tensorstore checks it as it builds the array and
does not read it a second time. Where the reader reads an array's chunks itself
(:mod:`.direct_read`), it does not open it in tensorstore at all: the checked zarr.json says all
it needs (:func:`metadata_chunk_rows`, :func:`metadata_checksums`).
"""

from __future__ import annotations

import json
import math
from typing import TYPE_CHECKING, Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

from ..core.errors import FormatError
from .chunk_checksums import ATTRIBUTE, attribute_crcs, chunk_count, crc_attributes
from .json_bounds import parse_json
from .paths import STORE_INDEX_CAP, SizeCap
from .kv_probe import ends_before, holds_byte, read_past
from .save_token import TOKEN_ATTRIBUTE, is_token

if TYPE_CHECKING:
    from ..planning.metadata import CheckpointIndex


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


# A zarr.json our writers store holds ~350 bytes, its shape's numbers and, in its attributes, one CRC-32C
# (at most 11 characters) per chunk; a chunk holds at least one row. A reader reads at most that of it
# (and STORE_INDEX_CAP): an OCDBT value may name any range of its data file, a sparse one costs nothing,
# and every array's zarr.json of a load is read at once.
_METADATA_BASE, _METADATA_PER_DIM, _METADATA_PER_CHUNK = 4096, 48, 12


def metadata_cap(recorded: "Recorded") -> int:
    """The most bytes the zarr.json of an array of the ``recorded`` shape holds as our writers store it."""
    chunks = max(1, int(recorded.shape[0])) if recorded.shape else 1
    return min(STORE_INDEX_CAP.limit(),
               _METADATA_BASE + _METADATA_PER_DIM * len(recorded.shape) + _METADATA_PER_CHUNK * chunks)


class _Read(NamedTuple):
    """One zarr.json's read: its future, or why there is none (``error``, raised by :meth:`result`)."""

    future: Any = None
    error: Optional[BaseException] = None
    oversized: bool = False
    state: str = "value"

    def result(self) -> Any:
        if self.error is not None:
            raise self.error
        return self if self.oversized else self.future.result()


def read_metadata(wanted: Dict[Any, Tuple[Any, str, "Recorded"]]) -> Dict[Any, _Read]:
    """Read the zarr.json of each array ``handle -> (kvstore, array path, recorded)``, concurrently: first
    the byte just past :func:`metadata_cap` (a kvstore says the value ends before it: OUT_OF_RANGE), then
    the values that end before it, whole. Each read's ``result()`` is the kvstore's read result (or
    raises its error); a value holding that byte is not read: :func:`parse_metadata` refuses it."""
    probes = {h: read_past(kv, metadata_key(path), metadata_cap(rec)) for h, (kv, path, rec) in wanted.items()}
    out: Dict[Any, _Read] = {}
    for h, probe in probes.items():
        kv, path, _ = wanted[h]
        try:
            past = probe.result()
        except Exception as e:  # noqa: BLE001 - raised by result(), where the caller names the array
            out[h] = _Read(kv.read(metadata_key(path))) if ends_before(e) else _Read(error=e)
            continue
        if holds_byte(past):
            out[h] = _Read(oversized=True)
        else:  # missing (the probe's result says so), or an empty answer (read whole: it is no larger)
            out[h] = _Read(error=None, future=probe) if past.state != "value" else _Read(kv.read(metadata_key(path)))
    return out


def read_capped(kvstore: Any, key: str, cap: SizeCap, where: str) -> Any:
    """The kvstore read result of ``key``; a value holding more than ``cap`` allows is refused unread (the
    byte past the cap read first: an OCDBT value may name any range of its data file, a sparse one
    costs nothing), with the FormatError naming ``where``, the cap and the variable raising it."""
    limit = cap.limit()
    try:
        past = read_past(kvstore, key, limit).result()
    except Exception as e:  # noqa: BLE001 - re-raised unless the value ends before the cap
        if not ends_before(e):
            raise
        return kvstore.read(key).result()
    if holds_byte(past):
        raise cap.refusal(where, None, limit)
    return past if past.state != "value" else kvstore.read(key).result()  # missing, or no larger than the cap


def parse_metadata(read_result: Any, where: str, recorded: Optional["Recorded"] = None) -> Optional[Dict[str, Any]]:
    """The metadata in a kvstore read of a zarr.json, None when it is missing. FormatError when it
    is larger than an array of the ``recorded`` shape has (:func:`metadata_cap`) or is not a JSON
    object (bad bytes, bad JSON, nesting too deep, parsing into far more memory than its size)."""
    if read_result.state != "value":
        return None
    raw = b"" if isinstance(read_result, _Read) else bytes(read_result.value)
    cap = metadata_cap(recorded) if recorded is not None else STORE_INDEX_CAP.limit()
    if isinstance(read_result, _Read) or len(raw) > cap:
        raise FormatError(f"{where}: its zarr.json holds more than the {cap} bytes the zarr.json of a "
                          f"{list(recorded.shape) if recorded is not None else ''} array holds as our writers "
                          f"store it; refused before reading it whole (damaged or hostile)")
    metadata = parse_json(raw, f"{where}: its zarr.json")
    if not isinstance(metadata, dict):
        raise FormatError(f"{where}: its zarr.json is not a JSON object: damaged")
    return metadata


def open_spec(array_spec: Dict[str, Any], metadata: Dict[str, Any]) -> Dict[str, Any]:
    """``array_spec`` (opening an array for reading) given the metadata read from its zarr.json."""
    return {**array_spec, "metadata": metadata}


# -- what a reader checks ----------------------------------------------------------------------
# Every zarr.json our writers produced (tensorstore 0.1.65 to 0.1.86, formats 1-6) has exactly these
# fields, in one form per dtype, shape and chunk shape: plain little-endian bytes, then the crc32c
# codec (formats 3-4; packs, empty arrays and object stores in format 5) or nothing (formats 1-2,
# and chunk checksums kept under ``attributes``, format 5). Anything else was not written by us: a
# digit flipped in ``shape`` reads the rows it leaves out as the template's, a changed
# ``data_type`` or endianness decodes bytes whose checksums still match into wrong values.
_FIELDS = ("zarr_format", "node_type", "shape", "data_type", "chunk_grid", "chunk_key_encoding", "fill_value",
           "codecs", "attributes")
_ENCODINGS = ({"name": "default"}, {"name": "default", "configuration": {"separator": "/"}})  # the same keys
_CRC_CODEC = {"name": "crc32c"}
_MISSING = object()


class Recorded(NamedTuple):
    """What ``metadata.json`` records of one stored array: its dtype and shape; a pack array
    (``pack``) is 1-D and at least ``shape[0]`` long (the end of the packed shards read from it)."""

    dtype: str
    shape: Tuple[int, ...]
    pack: bool = False
    token: Optional[str] = None  # the save's (format 7, storage/save_token.py), which the array records


class RecordedArrays:
    """``(writer, key, index)`` -> :class:`Recorded` for a checkpoint index's stored shards. A
    key's listed shards are indexed on the first question about it; an even split's chunk is
    computed (chunk i is written by rank i)."""

    def __init__(self, index: Optional["CheckpointIndex"]) -> None:
        self.index = index
        self.token = index.save_token if index is not None else None
        self._listed: Dict[str, Dict[Tuple[int, int], Tuple[int, ...]]] = {}

    def shard(self, writer: int, key: str, index: int, where: str) -> Recorded:
        """The array stored for shard ``index`` of ``key`` by ``writer``. FormatError when the
        index records none there, or two."""
        entry = self.index.tensors.get(key) if self.index is not None else None
        if entry is None:
            raise FormatError(f"{where}: metadata.json records no tensor {key!r}")
        if entry.even is not None:
            chunk = entry.even.chunks(entry.global_shape, index, index + 1) if writer == index else []
            if chunk:
                return Recorded(entry.dtype, chunk[0][2], False, self.token)
        elif key not in self._listed:
            listed: Dict[Tuple[int, int], Tuple[int, ...]] = {}
            for s in entry.shards:  # one array each: a second record would read the first's data as its own
                if (s.writer, s.index) in listed:
                    raise FormatError(f"{where}: metadata.json records two shards of {key!r} stored as shard {s.index} "
                                      f"of rank {s.writer} (one array): not written by us")
                listed[(s.writer, s.index)] = (s.flat[1] - s.flat[0],) if s.flat else tuple(s.shape)
            self._listed[key] = listed
        shape = self._listed.get(key, {}).get((writer, index))
        if shape is None:
            raise FormatError(f"{where}: metadata.json records no shard {index} of {key!r} written by rank {writer}")
        return Recorded(entry.dtype, shape, False, self.token)

    def read_whole(self, writer: int, key: str, index: int, src: Sequence[slice]) -> bool:
        """Whether ``src`` covers the whole array stored for shard ``index`` of ``key`` by ``writer``
        (False where metadata.json records none: opening it says what is wrong)."""
        try:
            shape = self.shard(writer, key, index, "").shape
        except FormatError:
            return False
        return len(src) == len(shape) and all(isinstance(s, slice) and s.indices(n) == (0, n, 1)
                                              for s, n in zip(src, shape))


def bytes_codec(data_type: str) -> Dict[str, Any]:
    """The ``bytes`` codec as tensorstore writes it for ``data_type`` (no endianness for one byte)."""
    one_byte = data_type in ("bool", "int8", "uint8") or data_type.startswith("float8")
    return {"name": "bytes"} if one_byte else {"name": "bytes", "configuration": {"endian": "little"}}


def canonical_metadata(shape: Sequence[int], data_type: str, chunks: Sequence[int], crc_codec: bool,
                       crcs: Optional[Sequence[int]], token: Optional[str] = None) -> Dict[str, Any]:
    """The zarr.json tensorstore writes for an array our writer creates (``create_metadata``)."""
    out = {"zarr_format": 3, "node_type": "array", "shape": list(shape), "data_type": data_type,
           "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(chunks)}},
           "chunk_key_encoding": {"name": "default"},
           "fill_value": _fill_value(data_type),
           "codecs": [bytes_codec(data_type)] + ([_CRC_CODEC] if crc_codec else [])}
    return {**out, "attributes": crc_attributes(crcs, token)} if crcs is not None or token is not None else out


def _fill_value(data_type: str) -> Any:
    """The zarr v3 fill value tensorstore writes for zeros of ``data_type`` (complex: [real, imaginary])."""
    if data_type == "bool":
        return False
    if data_type.startswith("complex"):
        return [0.0, 0.0]
    return 0 if data_type.startswith(("int", "uint")) else 0.0


def create_metadata(shape: Sequence[int], data_type: str, chunks: Sequence[int],
                    crcs: Optional[Sequence[int]], token: Optional[str] = None) -> Dict[str, Any]:
    """The metadata our writer creates an array with: ``crcs`` kept in its attributes, or else the
    ``crc32c`` codec checksums its chunks, and the save's ``token`` (tensorstore adds the other fields
    of :func:`canonical_metadata`)."""
    full = canonical_metadata(shape, data_type, chunks, crcs is None, crcs, token)
    return {k: full[k] for k in ("shape", "data_type", "chunk_grid", "codecs", "attributes") if k in full}


def metadata_chunk_rows(metadata: Dict[str, Any]) -> int:
    """Rows per chunk of an array whose zarr.json passed :func:`check_metadata` (a 0-d array: 1)."""
    chunks = metadata["chunk_grid"]["configuration"]["chunk_shape"]
    return int(chunks[0]) if chunks else 1


def metadata_checksums(metadata: Dict[str, Any], where: str, required: bool) -> Optional[Tuple[int, ...]]:
    """The chunk checksums an array's zarr.json (checked by :func:`check_metadata`) records, or None
    (then the ``crc32c`` codec checksums its chunks, or nothing does). FormatError when ``required``
    (the checkpoint records checksums) and it has none: its zarr.json was changed."""
    crcs = attribute_crcs(metadata, chunk_count(metadata["shape"], metadata_chunk_rows(metadata)), where)
    if crcs is None and required and _CRC_CODEC not in metadata["codecs"]:
        raise FormatError(f"{where} is stored without checksums although the checkpoint records them (its zarr.json "
                          f"was changed): damaged")
    return crcs


def check_metadata(metadata: Dict[str, Any], recorded: Recorded, where: str) -> None:
    """FormatError naming the first field of ``metadata`` (an array's zarr.json, as read) that is
    not as our writers store an array of the ``recorded`` dtype and shape: checked before the
    array is opened, so nothing is read through metadata that is not ours (layout, chunk grid,
    codecs, checksums). Cheap: a few small comparisons per array."""
    shape = list(recorded.shape)
    got_shape = metadata.get("shape")
    if recorded.pack and isinstance(got_shape, list) and len(got_shape) == 1 and type(got_shape[0]) is int \
            and got_shape[0] >= shape[0]:
        shape = got_shape  # a pack holds at least the packed shards read from it
    chunks = _chunk_shape(metadata.get("chunk_grid"), shape)
    codecs = metadata.get("codecs")
    crc_codec, crcs, bad = isinstance(codecs, list) and len(codecs) == 2, None, None
    try:
        if chunks is not None and not crc_codec:
            crcs = attribute_crcs(metadata, chunk_count(shape, chunks[0] if chunks else 1), where)
    except FormatError as e:  # raised in its turn: a changed shape or grid is named first
        bad = e
    want = canonical_metadata(shape, recorded.dtype, chunks or [], crc_codec, crcs, recorded.token)
    if metadata == want and chunks is not None and type(metadata["zarr_format"]) is int and all(
            type(s) is int for s in metadata["shape"]) and type(metadata["fill_value"]) is type(want["fill_value"]):
        return  # as written (``==`` takes 1 for 1.0 or true: the numbers' types checked; CRCs and chunks were)
    for name in _FIELDS + tuple(sorted(k for k in metadata if k not in _FIELDS)):
        got, expected = metadata.get(name, _MISSING), want.get(name, _MISSING)
        got = _MISSING if name == "attributes" and got == {} else got  # no attributes, as zarr reads it
        if name == "attributes" and bad is not None:
            raise bad
        if name == "attributes" and recorded.token is not None and got != expected:
            _attributes_changed(got, recorded.token, crc_codec, where)
        if name == "chunk_key_encoding" and got in _ENCODINGS or _same(got, expected) and (
                name != "chunk_grid" or chunks is not None):
            continue
        if name == "shape" and recorded.pack:
            what = f"a 1-D shape of at least {shape[0]} elements (the packed shards recorded)"
        elif name == "chunk_grid":
            what = f"a regular grid of whole trailing axes for shape {shape}"
        else:
            what = _render(expected)
        raise FormatError(f"{where}: its zarr.json field {name!r} is {_render(got)}, not {what} as written for the "
                          f"{recorded.dtype} array of shape {list(recorded.shape)} metadata.json records: not as "
                          f"our writer stores it (damaged or altered)")


def _attributes_changed(attributes: Any, token: str, crc_codec: bool, where: str) -> None:
    """FormatError saying what is wrong with the ``attributes`` of a format 7 array, where it is one of
    two things: they record another save's token than ``token`` (metadata.json's), or no checksums."""
    record = attributes.get(ATTRIBUTE) if isinstance(attributes, dict) else None
    stored = record.get(TOKEN_ATTRIBUTE) if isinstance(record, dict) else None
    if is_token(stored) and stored != token:
        raise FormatError(f"{where} was written by another save (its zarr.json records save {stored}, metadata.json "
                          f"save {token}): a rank store copied in from another checkpoint; nothing was read from it")
    if not crc_codec and not (isinstance(record, dict) and "crc32c" in record):
        raise FormatError(f"{where} is stored without checksums although the checkpoint records them (its zarr.json "
                          f"was changed): damaged")


def _chunk_shape(grid: Any, shape: Sequence[int]) -> Optional[List[int]]:
    """The chunk shape of a regular ``grid`` when it is one our writer makes for ``shape``: whole
    trailing axes (at least 1) and 1 to ``max(1, shape[0])`` rows; else None."""
    config = grid.get("configuration") if isinstance(grid, dict) else None
    chunks = config.get("chunk_shape") if isinstance(config, dict) else None
    if not isinstance(chunks, list) or len(chunks) != len(shape) or not all(type(c) is int for c in chunks):
        return None
    if shape and not (1 <= chunks[0] <= max(1, int(shape[0])) and chunks[1:] == [max(1, int(s)) for s in shape[1:]]):
        return None
    return chunks


def _same(a: Any, b: Any) -> bool:
    """JSON values equal with their types (``1`` is not ``1.0`` nor ``true``)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a is b or a == b


def _render(value: Any) -> str:
    if value is _MISSING:
        return "absent"
    try:
        text = json.dumps(value)
    except (ValueError, TypeError, RecursionError):
        text = type(value).__name__
    return text if len(text) <= 100 else text[:97] + "..."
