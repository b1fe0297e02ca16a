"""Every ```python block of docs/*.md runs as written, or, where it cannot here, names only what exists.

A block's kind is an HTML comment on the line right before its fence (mkdocs does not render it):

* no comment, or ``<!-- snippet: run -->``: self-contained. The ``run`` blocks of a page run in page order
  in one namespace (a later block may use what an earlier one made, as a reader following the page
  would), every page in one fresh ``python`` subprocess, each in a temporary directory of its own
  holding a copy of the repository's ``configs/`` (the docs' paths are from the root).
* ``<!-- snippet: torchrun N -->``: a complete program for N processes; run alone as a file with
  ``torchrun --standalone --nproc-per-node N`` (gloo on CPU), in its own temporary directory (``-m long``:
  CI does not select them).
* ``<!-- snippet: fragment, WHY -->``: a part of a program by design (a method body, a Trainer on 8
  nodes, an S3 bucket, a model the page leaves to the reader); WHY says what it needs. It is compiled,
  and every name it imports (``from X import a``, ``import X``) and every ``ldc.<name>`` /
  ``lightning_distckpt.<name>...`` attribute chain it uses must resolve.

Every block, whatever its kind, is compiled and name-checked. A block with any other comment fails
the test, so a new block is covered as soon as it is written. Tracebacks name ``docs/PAGE.md:LINE``.
"""

from __future__ import annotations

import ast
import importlib
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Dict, List, NamedTuple, Optional

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted((ROOT / "docs").glob("*.md"))
FENCE = re.compile(r"^```python\n(.*?)^```$", re.M | re.S)
MARKER = re.compile(r"<!-- snippet: (.*?) -->")
TIMEOUT_S = 300  # a failure bound only


class Block(NamedTuple):
    page: str  # "core.md"
    line: int  # 1-based line of the first line of code
    code: str
    kind: str  # "run", "torchrun", "fragment"
    nproc: int  # torchrun only

    @property
    def where(self) -> str:
        return f"docs/{self.page}:{self.line}"


def parse_kind(marker: Optional[str], where: str):
    if marker is None or marker == "run":
        return "run", 0
    m = re.fullmatch(r"torchrun (\d+)", marker)
    if m:
        return "torchrun", int(m.group(1))
    if re.fullmatch(r"fragment, \S.*", marker):
        return "fragment", 0
    raise AssertionError(f"{where}: unknown snippet kind {marker!r} (run, torchrun N, fragment, WHY)")


def blocks() -> List[Block]:
    out = []
    for page in PAGES:
        text = page.read_text()
        for m in FENCE.finditer(text):
            before = text[:m.start()].rstrip("\n").rsplit("\n", 1)[-1]
            marker = MARKER.fullmatch(before.strip())
            where = f"docs/{page.name}:{text.count(chr(10), 0, m.start()) + 2}"
            kind, nproc = parse_kind(marker.group(1) if marker else None, where)
            out.append(Block(page.name, text.count("\n", 0, m.start()) + 2, m.group(1), kind, nproc))
    return out


BLOCKS = blocks()


def _resolve(dotted: str, where: str) -> None:
    """Import the longest importable prefix of ``dotted``, then getattr the rest."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        for name in parts[i:]:
            assert hasattr(obj, name), f"{where}: {dotted} does not exist ({name!r} not in {obj!r})"
            obj = getattr(obj, name)
        return
    raise AssertionError(f"{where}: no module {dotted}")


def _dotted(node: ast.AST) -> Optional[str]:
    names = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return ".".join([node.id, *reversed(names)])
    return None


def used_names(code: str) -> List[str]:
    """The dotted names a block imports or reaches through a ``lightning_distckpt`` module alias."""
    tree = ast.parse(code)
    aliases: Dict[str, str] = {}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                out.append(a.name)
                aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.extend(f"{node.module}.{a.name}" for a in node.names)
            for a in node.names:
                if node.module.startswith("lightning_distckpt"):
                    aliases[a.asname or a.name] = f"{node.module}.{a.name}"
    aliases.setdefault("ldc", "lightning_distckpt")  # the docs' usual alias, imported or not
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            dotted = _dotted(node)
            if dotted:
                head, _, rest = dotted.partition(".")
                if aliases.get(head, "").startswith("lightning_distckpt"):
                    out.append(f"{aliases[head]}.{rest}")
    return sorted(set(out))


@pytest.mark.parametrize("block", BLOCKS, ids=[b.where for b in BLOCKS])
def test_block_compiles_and_names_exist(block: Block):
    compile(block.code, block.where, "exec")
    for name in used_names(block.code):
        _resolve(name, block.where)


def test_every_block_is_found():
    fences = sum(p.read_text().count("```python") for p in PAGES)
    assert len(BLOCKS) == fences, "a ```python fence the extraction missed (indented, or not closed by ```)"


RUN_PAGES = sorted({b.page for b in BLOCKS if b.kind == "run"})
# One interpreter for every page (importing torch and Lightning costs seconds a process): each page's blocks run
# in order in a namespace and a working folder of its own; a page that fails is reported and the next one runs.
DRIVER = textwrap.dedent("""
    import json, os, sys, traceback
    failed = []
    for page, folder, blocks in json.load(sys.stdin):
        os.chdir(folder)
        scope = {"__name__": "__main__"}
        try:
            for where, code in blocks:
                exec(compile(code, where, "exec"), scope)
        except BaseException:
            failed.append(page)
            print(f"=== docs/{page} failed:\\n{traceback.format_exc()}", file=sys.stderr)
    print("FAILED PAGES:", json.dumps(failed))
""")


def _env() -> Dict[str, str]:
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    for var in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(var, None)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def test_pages_run(tmp_path):
    todo = []
    for page in RUN_PAGES:
        folder = tmp_path / page.replace(".md", "")
        shutil.copytree(ROOT / "configs", folder / "configs")
        todo.append((page, str(folder), [(b.where, b.code) for b in BLOCKS if b.page == page and b.kind == "run"]))
    out = subprocess.run([sys.executable, "-c", DRIVER], input=json.dumps(todo), cwd=tmp_path, env=_env(),
                         capture_output=True, text=True, timeout=TIMEOUT_S * len(todo))
    text = out.stdout + out.stderr
    assert out.returncode == 0 and "FAILED PAGES: []" in out.stdout, f"pages failed:\n{text[-6000:]}"


TORCHRUN = [b for b in BLOCKS if b.kind == "torchrun"]


@pytest.mark.long  # several processes a block: tests/distributed covers the same calls
@pytest.mark.parametrize("block", TORCHRUN, ids=[b.where for b in TORCHRUN])
def test_torchrun_block_runs(block: Block, tmp_path):
    (tmp_path / "snippet.py").write_text(block.code)
    cmd = [os.path.join(os.path.dirname(sys.executable), "torchrun"), "--standalone",
           f"--nproc-per-node={block.nproc}", "snippet.py"]
    out = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=TIMEOUT_S)
    assert out.returncode == 0, f"{block.where} under torchrun failed:\n{(out.stdout + out.stderr)[-4000:]}"
