"""Validation of checkpoints in other formats: a PyTorch DCP directory or a Megatron-Core
``torch_dist`` directory (both read through their
:class:`~lightning_distckpt.reading.checkpoint.CheckpointSource`).

The index is checked (each tensor tiled exactly once by its chunks), every stored chunk is read
whole (a truncated or damaged ``.distcp`` record is a problem naming the tensor and the file), every
object and the common state are unpickled safely (a type that needs ``extra_safe_globals`` is a
warning). DCP stores no checksums of its own: each record read whole is checked against the CRC-32
of its zip record (:mod:`~lightning_distckpt.storage.zip_records`), which is said as a warning.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable, Optional

import torch

from ..core.errors import CheckpointingError, UnsafeContentError
from ..progress import Progress, set_total
from ..reading.checkpoint import CheckpointSource
from ..reading.formats.dcp import DcpSource, is_dcp_dir
from ..reading.formats.detect import detect
from ..reading.formats.megatron import MegatronSource, megatron_config
from ..storage.base import ShardRead
from ..storage.safe_pickle import loads
from ..storage.stores import open_store
from .checks import check_index
from .report import ValidationReport, short_error


def open_foreign(path: str) -> Optional[DcpSource]:
    """The source of a DCP or Megatron-Core directory; None for anything else (our own format)."""
    if not open_store(path).file_system or not os.path.isdir(path) or (
            megatron_config(path) is None and not is_dcp_dir(path)):
        return None
    source = detect(path)
    assert isinstance(source, DcpSource)
    return source


def format_name(source: DcpSource) -> str:
    """The format's name as the CLI shows it."""
    return "Megatron-Core torch_dist" if isinstance(source, MegatronSource) else "PyTorch DCP"


def validate_foreign(source: CheckpointSource, on_key: Optional[Callable[[str], None]] = None,
                     progress: Optional[Progress] = None) -> ValidationReport:
    """Check the index, read every stored chunk, object and the common state (see module docstring).
    ``on_key(key)`` is called as each key is checked; ``progress`` counts the bytes read."""
    t0 = time.perf_counter()
    report = ValidationReport(source.path, progress=progress)
    set_total(progress, sum(e.nbytes for e in source.index.tensors.values()))
    report.warnings.append(f"{format_name(source)}: the format stores no checksums of its own; each record is "
                           "checked against the CRC-32 torch.save gave it (not where it recorded none)")
    check_index(source, report)
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


def _check_value(report: ValidationReport, what: str, read: Callable[[], Any]) -> None:
    try:
        read()
    except UnsafeContentError as e:
        report.warnings.append(f"{what}: needs extra_safe_globals to load: {short_error(e)[:300]}")
    except CheckpointingError as e:
        report.problems.append(f"{what}: {short_error(e)}")
