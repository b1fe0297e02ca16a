"""``inspect`` and ``validate`` of checkpoints in other formats: a PyTorch DCP directory or a
Megatron-Core ``torch_dist`` directory (both read through their
:class:`~lightning_distckpt.reading.checkpoint.CheckpointSource`).

``inspect`` shows what the format's metadata says (tensors, their stored chunks and the files
holding them, objects, common state). ``validate`` checks the index (each tensor tiled exactly once
by its chunks), reads every stored chunk whole (a truncated or damaged ``.distcp`` record is a
problem naming the tensor and the file), every object and the common state (a type that needs
``extra_safe_globals`` is a warning). DCP stores no checksums: damage that leaves a record readable
goes unseen, which is said as a warning.
"""

from __future__ import annotations

import math
import os
import time
from typing import Any, Callable, Dict, List, Optional

import torch

from ..core.errors import CheckpointingError, UnsafeContentError
from ..planning.metadata import element_size
from ..progress import Progress, set_total
from ..reading.checkpoint import CheckpointSource
from ..reading.formats.dcp import DcpSource, is_dcp_dir
from ..reading.formats.detect import detect
from ..reading.formats.megatron import MegatronSource, megatron_config
from ..storage.base import ShardRead
from ..storage.safe_pickle import loads
from ..storage.s3_url import is_s3_url
from .inspect import _table, human_bytes, ranks_text, shard_grid
from .validate import Report, _check_index, short_error


def open_foreign(path: str) -> Optional[DcpSource]:
    """The source of a DCP or Megatron-Core directory; None for anything else (our own format)."""
    if is_s3_url(path) or not os.path.isdir(path) or (megatron_config(path) is None and not is_dcp_dir(path)):
        return None
    source = detect(path)
    assert isinstance(source, DcpSource)
    return source


def _format(source: DcpSource) -> str:
    return "Megatron-Core torch_dist" if isinstance(source, MegatronSource) else "PyTorch DCP"


def summarize_foreign(source: DcpSource) -> Dict[str, Any]:
    """A JSON-able description (``writers`` are the numbers of the data files, sorted by name)."""
    tensors = []
    for key in sorted(source.index.tensors):
        e = source.index.tensors[key]
        tensors.append({"key": key, "shape": list(e.global_shape), "dtype": e.dtype,
                        "bytes": math.prod(e.global_shape) * element_size(e.dtype), "stored_bytes": e.nbytes,
                        "shards": len(e.shards), **shard_grid(e)})
    objects = [{"key": k, "shape": list(o.global_shape), "elements": len(o.shards),
                "writers": sorted({s.writer for s in o.shards})} for k, o in sorted(source.index.objects.items())]
    files = source.data_files()
    return {"path": source.path, "format": _format(source), "data_files": [os.path.basename(f) for f in files],
            "data_file_bytes": sum(os.path.getsize(f) for f in files),
            "tensor_bytes": sum(t["stored_bytes"] for t in tensors), "tensors": tensors, "objects": objects}


def render_foreign(s: Dict[str, Any]) -> str:
    lines = [f"checkpoint   {s['path']}",
             f"format       {s['format']} (read by lightning_distckpt; no commit marker, no checksums)",
             f"storage      {len(s['data_files'])} data file(s), {human_bytes(s['data_file_bytes'])}",
             f"contents     {len(s['tensors'])} tensor(s), {human_bytes(s['tensor_bytes'])}; "
             f"{len(s['objects'])} object(s)", ""]
    rows = [[t["key"], str(tuple(t["shape"])), t["dtype"], human_bytes(t["bytes"]), str(t["shards"]),
             "x".join(map(str, t["grid"])) or "scalar", ranks_text(t["writers"])] for t in s["tensors"]]
    if rows:
        lines.append(_table(["key", "global shape", "dtype", "bytes", "chunks", "grid", "files"], rows))
    if s["objects"]:
        lines += ["", _table(["object key", "shape", "elements", "files"],
                             [[o["key"], str(tuple(o["shape"])), str(o["elements"]), ranks_text(o["writers"])]
                              for o in s["objects"]])]
    return "\n".join(lines)


def validate_foreign(source: CheckpointSource, on_key: Optional[Callable[[str], None]] = None,
                     progress: Optional[Progress] = None) -> Report:
    """Check the index, read every stored chunk, object and the common state (see module docstring).
    ``on_key(key)`` is called as each key is checked; ``progress`` counts the bytes read."""
    t0 = time.perf_counter()
    report = Report(source.path, progress=progress)
    set_total(progress, sum(e.nbytes for e in source.index.tensors.values()))
    report.warnings.append(f"{_format(source)}: the format stores no checksums; damage that leaves a record "
                           "readable goes undetected")
    _check_index(source, report)
    reader = source.reader()
    for key, entry in source.index.tensors.items():
        for s in entry.shards:
            dest = torch.empty(s.shape, dtype=entry.torch_dtype)
            try:
                report.count(reader.read_into([ShardRead(key, s.writer, s.index, (), dest)]))
            except CheckpointingError as e:
                report.problems.append(f"{key!r} chunk at {list(s.offset)}: {short_error(e)}")
            report.shards += 1
            report.chunks += 1
        if on_key is not None:
            on_key(key)
    for key, obj in source.index.objects.items():
        for s in obj.shards:
            report.objects += 1
            _check_value(report, f"object {key!r} at {list(s.offset)}",
                         lambda: loads(reader.read_object(s.writer, key, s.index), key))
    _check_value(report, "common state", lambda: source.load_common())
    report.seconds = time.perf_counter() - t0
    return report


def _check_value(report: Report, what: str, read: Callable[[], Any]) -> None:
    try:
        read()
    except UnsafeContentError as e:
        report.warnings.append(f"{what}: needs extra_safe_globals to load: {short_error(e)[:300]}")
    except CheckpointingError as e:
        report.problems.append(f"{what}: {short_error(e)}")


__all__: List[str] = ["open_foreign", "render_foreign", "summarize_foreign", "validate_foreign"]
