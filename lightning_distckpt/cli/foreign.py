"""``inspect`` (and ``validate``) of checkpoints in other formats: a PyTorch DCP directory or a
Megatron-Core ``torch_dist`` directory (both read through their
:class:`~lightning_distckpt.reading.checkpoint.CheckpointSource`); ``inspect`` also of a
``torch.save`` or ``.safetensors`` file and of a Hugging Face model directory (their tensors).

``inspect`` shows what the format's metadata says (tensors, their stored chunks and the files
holding them, objects, common state). ``validate``: :mod:`lightning_distckpt.validation.foreign`.
"""

from __future__ import annotations

import math
import os
from typing import Any, Dict, List, Optional

from ..core.shown import shown
from ..planning.metadata import element_size
from ..progress import Progress, advance, set_total
from ..reading.formats.dcp import DcpSource
from ..reading.formats.detect import detect, is_hf_model_directory
from ..reading.formats.files import SafetensorsFile
from ..reading.formats.tensor_files import TensorFileSource
from ..validation.foreign import format_name, open_foreign, validate_foreign
from .inspect import _table, human_bytes, ranks_text, shard_grid


def summarize_foreign(source: DcpSource, progress: Optional[Progress] = None) -> Dict[str, Any]:
    """A JSON-able description (``writers`` are the numbers of the data files, sorted by name);
    ``progress`` counts the keys described, as :func:`~.inspect.summarize` does for ours."""
    tensors = []
    set_total(progress, len(source.index.tensors))
    for key in sorted(source.index.tensors):
        e = source.index.tensors[key]
        advance(progress, 1)
        tensors.append({"key": key, "shape": list(e.global_shape), "dtype": e.dtype,
                        "bytes": math.prod(e.global_shape) * element_size(e.dtype), "stored_bytes": e.nbytes,
                        "shards": len(e.shards), **shard_grid(e)})
    objects = [{"key": k, "shape": list(o.global_shape), "elements": len(o.shards),
                "writers": sorted({s.writer for s in o.shards})} for k, o in sorted(source.index.objects.items())]
    files = source.data_files()
    return {"path": source.path, "format": format_name(source), "data_files": [os.path.basename(f) for f in files],
            "data_file_bytes": sum(os.path.getsize(f) for f in files),
            "tensor_bytes": sum(t["stored_bytes"] for t in tensors), "tensors": tensors, "objects": objects}


def render_foreign(s: Dict[str, Any]) -> str:
    lines = [f"checkpoint   {shown(s['path'], None)}",
             f"format       {shown(s['format'])} (read by lightning_distckpt; no commit marker, no checksums)",
             f"storage      {len(s['data_files'])} data file(s), {human_bytes(s['data_file_bytes'])}",
             f"contents     {len(s['tensors'])} tensor(s), {human_bytes(s['tensor_bytes'])}; "
             f"{len(s['objects'])} object(s)", ""]
    rows = [[shown(t["key"]), str(tuple(t["shape"])), shown(t["dtype"]), human_bytes(t["bytes"]), str(t["shards"]),
             "x".join(map(str, t["grid"])) or "scalar", ranks_text(t["writers"])] for t in s["tensors"]]
    if rows:
        lines.append(_table(["key", "global shape", "dtype", "bytes", "chunks", "grid", "files"], rows))
    if s["objects"]:
        lines += ["", _table(["object key", "shape", "elements", "files"],
                             [[shown(o["key"]), str(tuple(o["shape"])), str(o["elements"]), ranks_text(o["writers"])]
                              for o in s["objects"]])]
    return "\n".join(lines)


def open_tensor_files(path: str) -> Optional[TensorFileSource]:
    """The tensors of a ``torch.save`` / ``.safetensors`` file or a Hugging Face model directory
    (read without running code, as ``load`` reads them); None for anything else."""
    if not os.path.exists(path) or (os.path.isdir(path) and not is_hf_model_directory(path)):
        return None
    source = detect(path)
    return source if isinstance(source, TensorFileSource) else None


def summarize_tensor_files(source: TensorFileSource, progress: Optional[Progress] = None) -> Dict[str, Any]:
    """A JSON-able description of :func:`open_tensor_files`' source: its files, each tensor (key,
    shape, dtype, bytes, file) and, for a ``torch.save`` file, the names of its other entries."""
    kind = ("Hugging Face model directory" if os.path.isdir(source.path) else
            "safetensors file" if isinstance(source.files[0], SafetensorsFile) else "torch.save file")
    paths = [f.path for f in source.files]
    set_total(progress, len(source.index.tensors))
    tensors = []
    for key in sorted(source.index.tensors):
        e = source.index.tensors[key]
        advance(progress, 1)
        tensors.append({"key": key, "shape": list(e.global_shape), "dtype": e.dtype,
                        "bytes": math.prod(e.global_shape) * element_size(e.dtype),
                        "file": os.path.basename(source.file_of(key))})
    common = source.load_common()
    return {"path": source.path, "format": kind, "files": [os.path.basename(f) for f in paths],
            "file_bytes": sum(os.path.getsize(f) for f in paths),
            "tensor_bytes": sum(t["bytes"] for t in tensors), "tensors": tensors,
            "other_entries": sorted(map(str, common)) if isinstance(common, dict) else []}


def render_tensor_files(s: Dict[str, Any]) -> str:
    lines = [f"path         {shown(s['path'], None)}",
             f"format       {shown(s['format'])} (read by lightning_distckpt without running code; no checksums)",
             f"files        {len(s['files'])}, {human_bytes(s['file_bytes'])}",
             f"contents     {len(s['tensors'])} tensor(s), {human_bytes(s['tensor_bytes'])}"
             + (f"; other entries: {', '.join(map(shown, s['other_entries'][:12]))}"
                + (f", ... ({len(s['other_entries'])})" if len(s["other_entries"]) > 12 else "")
                if s["other_entries"] else ""), ""]
    by_file = len(s["files"]) > 1
    rows = [[shown(t["key"]), str(tuple(t["shape"])), shown(t["dtype"]), human_bytes(t["bytes"])]
            + ([shown(t["file"])] if by_file else [])
            for t in s["tensors"]]
    if rows:
        lines.append(_table(["key", "shape", "dtype", "bytes"] + (["file"] if by_file else []), rows))
    return "\n".join(lines)


__all__: List[str] = ["open_foreign", "open_tensor_files", "render_foreign", "render_tensor_files", "summarize_foreign",
                      "summarize_tensor_files", "validate_foreign"]
