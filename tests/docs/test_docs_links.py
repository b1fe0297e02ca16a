"""No page of the documentation cites a file that does not exist.

Checked in README.md and docs/*.md, inline code, fenced code and links alike:

* markdown links to relative targets (``[text](format.md#checksums)``): the file, relative to the page;
* repository paths: a token starting with a top-level folder of the repository (``benchmarks/...``,
  ``tests/...``, ``lightning_distckpt/...``) from the repository root, or with a subpackage
  (``storage/direct_read.py``) from ``lightning_distckpt/``;
* bare names of repository files (``save_load_run9.json``, ``bench_crc.py``): some file of the
  repository has that name, unless it is a file of a checkpoint or model directory.

Tokens written as patterns (``t/<key>/<i>/``, ``planning_run10_repeats[_cpu].json``, ``run{3,4}``) name
no single file and are skipped. Anchors (``#checksums``) are checked by ``mkdocs build --strict``.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Iterator, List, Set, Tuple

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TOP_DIRS = (".ci", "benchmarks", "configs", "docs", "examples", "lightning_distckpt", "tests")
SUBPACKAGES = tuple(p.name for p in (ROOT / "lightning_distckpt").iterdir() if (p / "__init__.py").is_file())
# Files of checkpoints, model directories and tools, named in the docs but not part of this repository.
NOT_REPO_FILES = {"metadata.json", "zarr.json", "config.json", "model.safetensors.index.json",
                  "pytorch_model.bin.index.json", "manifest.json"}
PATTERN_CHARS = "<>[]{}*"

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
# A path: after a character that cannot continue one; a folder, then path characters.
REPO_PATH = re.compile(r"(?<![\w./~-])((?:%s)/[\w./-]*)" % "|".join(re.escape(d) for d in TOP_DIRS))
PACKAGE_PATH = re.compile(r"(?<![\w./~-])((?:%s)/[\w/-]*\.py)\b" % "|".join(SUBPACKAGES))
BARE_FILE = re.compile(r"(?<![\w./~-])([\w-]+(?:\.[\w-]+)*\.(?:py|json|yaml|yml|sh|toml))(?![\w/])")


def repo_file_names() -> Set[str]:
    names: Set[str] = set()
    for top, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if not d.startswith(".") or d == ".ci"]
        dirs[:] = [d for d in dirs if d not in ("__pycache__", "site", "node_modules") and not d.endswith(".egg-info")]
        names.update(files)
    return names


def followed_by_pattern(text: str, end: int) -> bool:
    return end < len(text) and text[end] in PATTERN_CHARS


def cited_paths(page: Path) -> Iterator[Tuple[str, Path]]:
    """(the token as written, the file it must be) for every link and repository path on ``page``."""
    text = page.read_text()
    for m in LINK.finditer(text):
        target = m.group(1).split("#", 1)[0]
        if target and not re.match(r"^[a-z][a-z0-9+.-]*:", target):  # not http:, mailto:, ...
            yield m.group(1), (page.parent / target)
    for pattern, base in ((REPO_PATH, ROOT), (PACKAGE_PATH, ROOT / "lightning_distckpt")):
        for m in pattern.finditer(text):
            token = m.group(1).rstrip(".")
            if followed_by_pattern(text, m.end(1)) or not token.rstrip("/"):
                continue
            yield token, base / token


def cited_names(page: Path) -> Iterator[str]:
    text = page.read_text()
    for m in BARE_FILE.finditer(text):
        name = m.group(1)
        placeholder = name.split(".", 1)[0].isupper()  # RESULTS.json, OUT.json: the reader's own file
        if not (followed_by_pattern(text, m.end(1)) or placeholder or name in NOT_REPO_FILES):
            yield name


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_cited_path_exists(page):
    missing: List[str] = sorted({token for token, path in cited_paths(page) if not path.exists()})
    assert not missing, f"{page.relative_to(ROOT)} cites paths that do not exist: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_cited_file_name_exists(page):
    names = repo_file_names()
    missing = sorted({name for name in cited_names(page) if name not in names})
    assert not missing, f"{page.relative_to(ROOT)} names files the repository does not have: {missing}"


def test_the_checker_finds_what_it_should(tmp_path):
    """The patterns catch a missing result file, a dead link and a missing module, and skip patterns."""
    page = tmp_path / "page.md"
    page.write_text("See [the format](nowhere.md#x) and `benchmarks/results/save_load_run1.json`, "
                    "`storage/no_such_module.py`, `t/<key>/<i>/`, `planning_run10_repeats[_cpu].json`, "
                    "`benchmarks/bench_save_load.py --json out.json RESULTS.json`, [site](https://example.org/a.md).\n")
    tokens = {token for token, path in cited_paths(page) if not path.exists()}
    assert tokens == {"nowhere.md#x", "benchmarks/results/save_load_run1.json", "storage/no_such_module.py"}
    assert set(cited_names(page)) == {"out.json"}
