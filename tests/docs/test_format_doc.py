"""docs/format.md states the format version this library writes, and the versions it still reads, as the code
defines them (it said 6, with 1 to 4 still read, while the library wrote 7 and read 1 to 6)."""

from __future__ import annotations

import os

from lightning_distckpt.core.format_versions import FORMAT_VERSION, SUPPORTED_FORMAT_VERSIONS

_DOC = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "format.md")


def test_format_doc_states_the_written_and_read_versions():
    with open(_DOC, encoding="utf-8") as f:
        text = f.read()
    older = [v for v in SUPPORTED_FORMAT_VERSIONS if v < FORMAT_VERSION]  # 8: written only with aliases
    assert older == list(range(1, FORMAT_VERSION))  # what the sentence below can say as a range
    assert f"The current format version is **{FORMAT_VERSION}**" in text
    assert f"every earlier version (1 to {FORMAT_VERSION - 1}) still loads" in text
    assert "`FORMAT_VERSION` in `lightning_distckpt/core/format_versions.py`" in text
    assert f"| `format_version` | `{FORMAT_VERSION}`; 1 to {FORMAT_VERSION - 1} are still read" in text
