"""The README's programs are the files in examples/readme/, shown verbatim, and each one runs as its
first line (``# Run: ...``) says: Lightning and Fabric launch their own processes, torchrun the core one.

Each program runs for real in a fresh directory holding a copy of examples/readme/ (they write under
``checkpoints/`` relative to where they run), with this interpreter's ``python`` and ``torchrun`` first
on PATH.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Dict

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "readme"
# A program is shown as: <!-- file: examples/readme/NAME --> on its own line, then a fenced block.
SHOWN = re.compile(r"^<!-- file: (examples/readme/[\w.-]+) -->\n```\w+\n(.*?)^```$", re.M | re.S)
RUN_LINE = re.compile(r"\A# Run: (.+)\n")
TIMEOUT_S = 300  # a failure bound only: each program takes seconds to tens of seconds


def shown_programs() -> Dict[str, str]:
    return {name: text for name, text in SHOWN.findall((ROOT / "README.md").read_text())}


def run_command(name: str) -> str:
    match = RUN_LINE.match((EXAMPLES / name).read_text())
    assert match, f"examples/readme/{name} must start with a '# Run: COMMAND' line"
    return match.group(1)


def run_program(name: str, cwd: Path) -> str:
    """Run ``name``'s command in ``cwd`` (examples/readme/ copied there once); return its output."""
    if not (cwd / "examples" / "readme").is_dir():
        shutil.copytree(EXAMPLES, cwd / "examples" / "readme")
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    for var in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):  # a fresh launch each time
        env.pop(var, None)
    out = subprocess.run(["bash", "-c", run_command(name)], cwd=cwd, env=env, capture_output=True, text=True,
                         timeout=TIMEOUT_S)
    text = out.stdout + out.stderr
    assert out.returncode == 0, f"{name} failed ({out.returncode}):\n{text[-4000:]}"
    return text


def test_every_program_is_shown_verbatim():
    files = sorted(f"examples/readme/{p.name}" for p in EXAMPLES.iterdir() if p.suffix in (".py", ".sh"))
    shown = shown_programs()
    assert sorted(shown) == files, "every file in examples/readme/ is shown once in README.md, and only those"
    for name, text in shown.items():
        assert text == (ROOT / name).read_text(), f"README.md's copy of {name} differs from the file"


def test_readme_is_short_and_keeps_the_setup_commands():
    text = (ROOT / "README.md").read_text()
    assert len(text.encode()) <= 10_000
    assert "pip install -e . && python examples/train_gpt_tp.py" in text
    assert 'pip install -e ".[test]" && python -m pytest -q tests' in text


@pytest.mark.slow
def test_trainer_resumes_on_another_number_of_processes_then_converts(tmp_path):
    out = run_program("trainer.py", tmp_path)
    assert "rank 0 of 2: at step 4" in out and "rank 1 of 2: at step 4" in out
    assert "Restored all states from the checkpoint" in out and "rank 0 of 1: at step 8" in out
    assert (tmp_path / "checkpoints" / "trainer" / "last.ckpt" / "COMMITTED").is_file()

    run_program("convert.sh", tmp_path)
    from lightning.pytorch.demos.boring_classes import BoringModel
    from safetensors.torch import load_file

    import lightning_distckpt as ldc

    ckpt = tmp_path / "checkpoints"
    stored = ldc.load_plain_tensors(ckpt / "trainer" / "last.ckpt")
    model = BoringModel.load_from_checkpoint(ckpt / "model.ckpt")  # what the comment promises
    assert torch.equal(model.layer.weight, stored["state_dict/layer.weight"])
    assert torch.equal(load_file(ckpt / "hf" / "model.safetensors")["layer.weight"], stored["state_dict/layer.weight"])
    assert torch.equal(ldc.load_plain_tensors(ckpt / "imported")["state_dict/layer.weight"],
                       stored["state_dict/layer.weight"])


@pytest.mark.slow
def test_model_parallel_resumes_under_another_mesh(tmp_path):
    out = run_program("model_parallel.py", tmp_path)
    assert "rank 0: DP 1 x TP 2, at step 4" in out and "rank 1: DP 1 x TP 2, at step 4" in out
    assert "Restored all states from the checkpoint" in out
    assert "rank 0: DP 2 x TP 1, at step 8" in out and "rank 1: DP 2 x TP 1, at step 8" in out


def test_fabric_saves_and_loads_on_another_number_of_processes(tmp_path):
    out = run_program("fabric.py", tmp_path)
    assert "2 process(es): saved step 4" in out and "1 process(es): saved step 8" in out


def test_core_save_and_load_under_another_split(tmp_path):
    out = run_program("core.py", tmp_path)
    assert "rank 0: columns 0 to 3 of 'weight'" in out and "rank 1: columns 3 to 6 of 'weight'" in out


def test_files_in_and_out(tmp_path):
    run_program("files.py", tmp_path)  # the program asserts its own results
    assert (tmp_path / "checkpoints" / "files_hf" / "model.safetensors").is_file()


@pytest.mark.parametrize("name", ["trainer.py", "model_parallel.py", "fabric.py", "core.py", "files.py",
                                  "convert.sh"])
def test_each_program_has_a_run_line(name):
    assert f"examples/readme/{name}" in run_command(name)
