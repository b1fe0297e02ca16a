"""What :func:`lightning_distckpt.validate` found: :class:`ValidationReport`."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from ..core.errors import without_http_detail
from ..progress import Progress, advance

_SPEC_TAIL = re.compile(r"\s*\[(tensorstore_spec|transform|domain)=.*$", re.S)


@dataclass
class ValidationReport:
    """What :func:`~lightning_distckpt.validate` found in one checkpoint.

    Attributes:
        path: the checkpoint validated.
        problems: damage: missing or unreadable data, a broken index, a checksum that does not match.
        warnings: what could not be fully checked (a format without checksums, a type that needs
            ``extra_safe_globals`` to load).
        shards: stored shards read.
        chunks: chunk reads made.
        bytes_read: bytes read and verified.
        objects: stored objects read.
        seconds: how long it took.
        progress: the :mod:`lightning_distckpt.progress` counter of bytes read (``validate``'s).
    """

    path: str
    problems: List[str] = field(default_factory=list)
    warnings: List[str] = field(default_factory=list)
    shards: int = 0
    chunks: int = 0
    bytes_read: int = 0
    objects: int = 0
    seconds: float = 0.0
    progress: Optional[Progress] = field(default=None, repr=False, compare=False)  # counts bytes as they are read

    @property
    def ok(self) -> bool:
        """True when nothing is damaged (warnings allowed)."""
        return not self.problems

    def count(self, nbytes: int) -> None:
        """``nbytes`` more read (and shown on the progress bar)."""
        self.bytes_read += nbytes
        advance(self.progress, nbytes)

    def to_json(self) -> Dict[str, Any]:
        """The report as JSON-able data (what ``lightning-distckpt validate --json`` prints)."""
        return {"path": self.path, "ok": self.ok, "problems": self.problems, "warnings": self.warnings,
                "shards": self.shards, "chunks": self.chunks, "objects": self.objects,
                "bytes_read": self.bytes_read, "seconds": round(self.seconds, 3)}


def short_error(e: BaseException) -> str:
    """An exception's message without tensorstore's trailing spec dump and HTTP answer bodies."""
    return without_http_detail(_SPEC_TAIL.sub("", str(e))).strip() or type(e).__name__
