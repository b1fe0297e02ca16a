"""``inspect``: what a checkpoint holds, from its metadata alone (no array data is read)."""

from __future__ import annotations

import math
import os
import time
from typing import Any, Dict, Iterable, List, Optional, Sequence

from ..core.shown import shown
from ..planning.metadata import TensorEntry, element_size
from ..reading.checkpoint import OpenedCheckpoint
from ..progress import Progress, advance, set_total


def ranks_text(ranks: Iterable[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"``."""
    out: List[str] = []
    rs = sorted(set(ranks))
    i = 0
    while i < len(rs):
        j = i
        while j + 1 < len(rs) and rs[j + 1] == rs[j] + 1:
            j += 1
        out.append(str(rs[i]) if i == j else f"{rs[i]}-{rs[j]}")
        i = j + 1
    return ",".join(out)


def shard_grid(entry: TensorEntry) -> Dict[str, Any]:
    """How a tensor is cut into stored shards: number of distinct offsets per axis (``grid``),
    the offsets themselves (axes that are split only), flattened pieces, writer ranks."""
    ndim = len(entry.global_shape)
    boxes = {(tuple(s.offset), tuple(s.shape)) for s in entry.shards}
    per_axis = [sorted({off[a] for off, _ in boxes}) for a in range(ndim)]
    return {
        "grid": [len(offs) for offs in per_axis],
        "split_axes": {a: per_axis[a] for a in range(ndim) if len(per_axis[a]) > 1},
        "boxes": len(boxes),
        "flat_pieces": sum(1 for s in entry.shards if s.flat is not None),
        "packed": sum(1 for s in entry.shards if s.packed is not None),
        "writers": sorted({s.writer for s in entry.shards}),
    }


def summarize(ckpt: OpenedCheckpoint, progress: Optional[Progress] = None) -> Dict[str, Any]:
    """A JSON-able description of the checkpoint; ``progress`` counts the keys described (a
    checkpoint with millions of shards takes a while)."""
    meta = ckpt.meta
    tensors = []
    set_total(progress, len(ckpt.index.tensors))
    aliases = ckpt.index.aliases
    for key in sorted(ckpt.index.tensors):
        e = ckpt.index.tensors[key]
        g = shard_grid(e)
        advance(progress, 1)
        tensors.append({
            "key": key, "shape": list(e.global_shape), "dtype": e.dtype,
            "bytes": math.prod(e.global_shape) * element_size(e.dtype),
            # an alias (format 8) stores nothing of its own: its shards are its target's, counted there
            "stored_bytes": 0 if key in aliases else e.nbytes, "shards": len(e.shards), **g,
            "alias_of": aliases.get(key),
        })
    stored = [t for t in tensors if t["alias_of"] is None]
    objects = []
    for key in sorted(ckpt.index.objects):
        o = ckpt.index.objects[key]
        objects.append({"key": key, "shape": list(o.global_shape), "elements": len(o.shards),
                        "writers": sorted({s.writer for s in o.shards})})
    marker = ckpt.marker
    facts = ckpt.storage_facts()  # as its store knows them
    return {
        "path": ckpt.path,
        "committed": True,  # OpenedCheckpoint.open refuses anything else
        "format": meta.get("format"), "format_version": meta.get("format_version"),
        "checksums": ckpt.index.checksums,
        "library_version": meta.get("library_version"), "torch_version": meta.get("torch_version"),
        "world_size": meta.get("world_size"), "created_unix": meta.get("created_unix"),
        "committed_unix": marker.get("committed_unix"), "storage": meta.get("storage", {}),
        "tensor_bytes": sum(t["stored_bytes"] for t in stored),
        "common_bytes": facts.common_bytes, "data_files": facts.data_files, "data_file_bytes": facts.data_bytes,
        "stored_arrays": sum(t["shards"] - t["packed"] for t in stored) + len(
            {(s.writer, e.dtype) for e in ckpt.index.tensors.values() for s in e.shards if s.packed is not None}),
        "packed_shards": sum(t["packed"] for t in stored),
        "tensors": tensors, "objects": objects,
        "leftovers": facts.leftovers, "foreign": list(facts.foreign),
    }


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _table(headers: Sequence[str], rows: List[Sequence[str]]) -> str:
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]
    fmt = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
    return "\n".join([fmt(headers), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows])


def _when(t: Any) -> str:
    try:  # a marker's time is any finite number: one past the platform's time_t shows as itself
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if isinstance(t, (int, float)) else "?"
    except (OverflowError, OSError, ValueError):
        return f"unix time {t:g}"


def render(s: Dict[str, Any]) -> str:
    """The summary as text: a header and one row per tensor / object; every text from the
    checkpoint (keys, versions, file names) :func:`shown`."""
    st = s["storage"]
    lines = [
        f"checkpoint   {shown(s['path'], None)}",
        f"status       committed (complete) at {_when(s['committed_unix'])}",
        f"format       {shown(s['format'])} v{s['format_version']}, written by lightning_distckpt "
        f"{shown(s['library_version'])} (torch {shown(s['torch_version'])}) on {s['world_size']} rank(s); "
        + ("checksums on every chunk, object, common.pt and metadata.json" if s["checksums"] else
           "NO checksums (written before format 3)"),
        f"storage      {shown(st.get('backend', '?'))} / {shown(st.get('layout', '?'))}, "
        f"chunks <= {human_bytes(st.get('chunk_bytes', 0))}; "
        f"{s['data_files']} data file(s), "
        f"{human_bytes(s['data_file_bytes']) if s['data_file_bytes'] is not None else 'sizes not listed'}; "
        f"{s['stored_arrays']} array(s)"
        + (f", {s['packed_shards']} small shard(s) packed" if s["packed_shards"] else ""),
        f"contents     {len(s['tensors'])} tensor(s), {human_bytes(s['tensor_bytes'])}; {len(s['objects'])} object(s); "
        f"common state {human_bytes(s['common_bytes']) if s['common_bytes'] is not None else 'MISSING'}",
    ]
    if s["leftovers"]:
        lines.append(
            f"leftovers    {len(s['leftovers'])} staging director(ies) of saves to this name that did not commit "
            f"({human_bytes(sum(lo['bytes'] or 0 for lo in s['leftovers']))}): lightning-distckpt clean "
            f"{shown(os.path.dirname(s['path']), None)}"
        )
    for entry in s["foreign"]:
        lines.append(f"foreign      {shown(entry)}: not written by a save (a load never reads it; left alone)")
    lines.append("")
    rows = []
    for t in s["tensors"]:
        split = "; ".join(f"axis {a} at {_offsets(o)}" for a, o in t["split_axes"].items())
        if t["flat_pieces"]:
            split = (split + "; " if split else "") + f"{t['flat_pieces']} flattened piece(s)"
        if t.get("alias_of") is not None:  # tied: stored once, under its target's key
            split = f"alias of {shown(t['alias_of'])}: " + (split or "whole")
        rows.append([shown(t["key"]), str(tuple(t["shape"])), shown(t["dtype"]), human_bytes(t["bytes"]),
                     str(t["shards"]), "x".join(map(str, t["grid"])) or "scalar", ranks_text(t["writers"]),
                     split or "whole"])
    if rows:
        lines.append(_table(["key", "global shape", "dtype", "bytes", "shards", "grid", "writers", "split"], rows))
    if s["objects"]:
        lines.append("")
        lines.append(_table(["object key", "shape", "elements", "writers"],
                            [[shown(o["key"]), str(tuple(o["shape"])), str(o["elements"]),
                              ranks_text(o["writers"])] for o in s["objects"]]))
    return "\n".join(lines)


def _offsets(offs: Sequence[int]) -> str:
    if len(offs) <= 4:
        return ",".join(map(str, offs))
    steps = {b - a for a, b in zip(offs, offs[1:])}
    if len(steps) == 1:
        return f"{offs[0]}..{offs[-1]} step {steps.pop()}"
    return f"{offs[0]},{offs[1]},...,{offs[-1]} ({len(offs)} offsets)"
