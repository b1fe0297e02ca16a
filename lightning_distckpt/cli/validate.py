"""``lightning-distckpt validate``: prints the :class:`~lightning_distckpt.validation.ValidationReport`
of :func:`lightning_distckpt.validate` (the engine: :mod:`lightning_distckpt.validation`)."""

from __future__ import annotations

from typing import Any, Dict

from ..core.shown import MESSAGE_LIMIT, shown
from ..validation import ValidationReport, validate

__all__ = ["as_json", "render", "validate"]


def render(report: ValidationReport, limit: int = 50) -> str:
    """The report as the lines the command prints: each problem and warning (at most ``limit`` of
    each), then one status line. A problem names what the checkpoint holds: :func:`shown`, so that
    no name in it prints a line of its own (a forged ``OK``) or an escape sequence."""
    lines = []
    for p in report.problems[:limit]:
        lines.append(f"PROBLEM  {shown(p, MESSAGE_LIMIT)}")
    if len(report.problems) > limit:
        lines.append(f"PROBLEM  ... and {len(report.problems) - limit} more")
    for w in report.warnings[:limit]:
        lines.append(f"WARNING  {shown(w, MESSAGE_LIMIT)}")
    status = "OK" if report.ok else f"DAMAGED ({len(report.problems)} problem(s))"
    lines.append(
        f"{status}: {shown(report.path, None)}: read {report.shards} stored shard(s) in {report.chunks} chunk read(s), "
        f"{report.objects} object(s) and the common state, {report.bytes_read} bytes in {report.seconds:.2f}s"
    )
    return "\n".join(lines)


def as_json(report: ValidationReport) -> Dict[str, Any]:
    """The report as JSON-able data (``--json``)."""
    return report.to_json()
