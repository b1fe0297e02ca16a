"""Chunks of a DCP checkpoint written in DCP's SAFETENSORS format.

``FileSystemWriter(path, serialization_format=SerializationFormat.SAFETENSORS)`` writes each rank's
objects (``torch.save``d bytes) first and then appends one safetensors file holding the rank's tensor
chunks, one entry per fully qualified name, with ``__metadata__["DCP_SHARDING_INFO"]`` giving each
chunk's ``saved_offsets``. Its ``.metadata`` records every chunk at the start of that safetensors
file with the chunk's byte count as length (torch's ``FileSystemReader`` cannot read it back).

:func:`resolve_safetensors` finds such files (every tensor item of the file at one offset, where a
safetensors file begins), checks the header (:mod:`.safetensors_header`: offsets in bounds, packed,
dtypes known) against ``.metadata`` (each chunk named once, of the dtype, shape, offsets and byte
count ``.metadata`` declares; no entry left over) and points each chunk at its own bytes, marked
``raw``: the reader then reads the pieces it needs from them directly. Safetensors records no
checksum: the bytes are read as stored. That format with ``_extensions=[ZStandard()]``, which torch's
own reader cannot read back, is refused naming the combination (:func:`_refuse_compressed`).
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import BinaryIO, Callable, Dict, List, Tuple

from ...core.errors import FormatError
from ...core.shown import shown
from ...storage.layout import parse_json
from .dcp_chunks import safetensors_at
from .dcp_metadata import DcpChunk, DcpItem, DcpMetadata, DcpTensor
from .safetensors_header import Header, read_open_header

SHARDING_KEY = "DCP_SHARDING_INFO"  # torch.distributed.checkpoint._hf_utils.CUSTOM_METADATA_KEY

# (fqn, the tensor, its list holding the chunk, the chunk's position there)
_Placed = Tuple[str, DcpTensor, List[DcpChunk], int]


def resolve_safetensors(meta: DcpMetadata, full_paths: Dict[str, str], open_file: Callable[[str], BinaryIO]) -> None:
    """Point each chunk stored in DCP's SAFETENSORS format at its own bytes (``raw`` items), in place;
    other files are left as they are. A header that does not match ``.metadata`` is a FormatError
    naming the file and the tensor."""
    by_file: Dict[str, List[_Placed]] = defaultdict(list)
    for fqn, tensor in meta.tensors.items():
        for chunks in (tensor.chunks, tensor.stored_empty):
            for i, chunk in enumerate(chunks):
                by_file[chunk.item.file].append((fqn, tensor, chunks, i))
    for rel, placed in by_file.items():
        items = [chunks[i].item for _, _, chunks, i in placed]
        starts = {item.offset for item in items}
        full = full_paths[rel]
        compressed = any(item.transforms for item in items)
        if compressed:
            _refuse_compressed(shown(full), items, open_file(full))
        if len(starts) != 1 or compressed:
            continue  # DCP's default format: each chunk a torch.save archive of its own
        with open_file(full) as f:
            if not safetensors_at(f, items[0].offset):
                continue
            try:
                header = read_open_header(f, shown(full), items[0].offset)
            except FormatError as e:  # the file's one chunk damaged into a header's start, or a forged header
                fqn, _, chunks, i = placed[0]
                more = f" (and {len(placed) - 1} more)" if len(placed) > 1 else ""
                why = str(e).removeprefix(f"{shown(full)}: ")
                raise FormatError(f"{shown(full)}: tensor {fqn!r} chunk at {list(chunks[i].offset)}{more}: its stored "
                                  f"bytes begin a safetensors file (DCP's SAFETENSORS format), which is not sound: "
                                  f"{why}") from None
        _point_at_entries(shown(full), placed, header)


def _refuse_compressed(where: str, items: List[DcpItem], f: BinaryIO) -> None:
    """Refuse what ``FileSystemWriter(serialization_format=SAFETENSORS, _extensions=[ZStandard()])``
    writes (torch 2.13): each tensor item an empty zstd frame of a few bytes, recorded with the
    tensor's byte count as its length (so the items' ranges overlap), then the rank's safetensors
    file, uncompressed, after the last frame. torch's ``FileSystemReader`` cannot read it back (its
    zstd decoder meets the next frame or the safetensors header). Closes ``f``."""
    with f:
        last = max(item.offset for item in items)
        # an empty zstd frame is 9 to 18 bytes: the safetensors file begins a few bytes past the last one
        # (in DCP's TORCH_SAVE format compressed, a frame of a torch.save archive is there instead)
        if not any(safetensors_at(f, last + gap) for gap in range(1, 32)):
            return
    raise FormatError(f"{where}: written by DCP's FileSystemWriter(serialization_format=SerializationFormat."
                      "SAFETENSORS, _extensions=[ZStandard()]), which stores each tensor as an empty zstd frame "
                      "before an uncompressed safetensors file; torch's FileSystemReader cannot read that "
                      "combination back either. Re-save with serialization_format=TORCH_SAVE (compressed with "
                      "_extensions=[ZStandard()] or not), or SAFETENSORS without _extensions")


def _sharding_info(where: str, header: Header) -> Dict[str, object]:
    """The header's ``DCP_SHARDING_INFO``: ``{fqn: {"saved_offsets": [...]}}``."""
    text = (header.metadata or {}).get(SHARDING_KEY)
    if text is None:
        raise FormatError(f"{where}: the safetensors header holds no {SHARDING_KEY} in its __metadata__, which DCP's "
                          "SAFETENSORS format writes (not a DCP checkpoint's file)")
    # a name given twice is read as the last by some readers, the first by others: refused
    info = parse_json(text.encode(), f"{where}: {SHARDING_KEY}", unique_keys=True)
    if not isinstance(info, dict):
        raise FormatError(f"{where}: {SHARDING_KEY} must be a JSON object, got {type(info).__name__}")
    return info


def _point_at_entries(where: str, placed: List[_Placed], header: Header) -> None:
    entries = {e.name: e for e in header.entries}
    info = _sharding_info(where, header)
    for fqn, tensor, chunks, i in placed:
        chunk = chunks[i]
        what = f"{where}: tensor {fqn!r} chunk at {list(chunk.offset)}"
        entry = entries.pop(fqn, None)
        if entry is None:
            raise FormatError(f"{what}: the file's safetensors header has no entry {fqn!r} (or .metadata places "
                              "two chunks of it in this file, where DCP's SAFETENSORS format stores one)")
        saved = info.get(fqn)
        offsets = saved.get("saved_offsets") if isinstance(saved, dict) else None
        if entry.dtype != tensor.dtype or entry.shape != chunk.shape or offsets != list(chunk.offset) \
                or entry.end - entry.begin != chunk.item.length:
            raise FormatError(f"{what}: the safetensors header stores it as {entry.dtype} {list(entry.shape)} at "
                              f"offsets {str(offsets)[:100]} ({entry.end - entry.begin} bytes), but .metadata declares "
                              f"{tensor.dtype} {list(chunk.shape)} ({chunk.item.length} bytes)")
        item = dataclasses.replace(chunk.item, offset=header.data_start + entry.begin, raw=True)
        chunks[i] = dataclasses.replace(chunk, item=item)
    if entries:
        raise FormatError(f"{where}: its safetensors header holds {sorted(entries)[:3]}, which .metadata does not "
                          "place in this file")
