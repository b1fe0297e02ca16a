"""A new user's first hour: the mistakes one makes with the core API, the examples and logging, each
answered with what is wrong, where, and what to do (the Trainer's and the YAML's are in
tests/lightning/test_first_hour_hints.py). One process each, no process group, real files."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import lightning_distckpt as ldc
from lightning_distckpt.core.errors import (CheckpointingError, CheckpointNotFoundError, FormatError,
                                            IncompleteCheckpointError, MissingKeysError, ShardingError)

ROOT = Path(__file__).resolve().parents[2]


def _st(key: str, tensor: torch.Tensor) -> ldc.ShardedTensor:
    return ldc.ShardedTensor.from_rank_offsets(key, tensor)


def _dirpath_of_two(tmp_path: Path) -> Path:
    """What ModelCheckpoint's dirpath looks like to the core API: two committed checkpoints, 'b' newer."""
    ckpts = tmp_path / "ckpts"
    for i, name in enumerate(("a", "b")):
        ldc.save({"w": _st("w", torch.ones(4, 4))}, str(ckpts / name))
        os.utime(ckpts / name, (1_000_000 + i, 1_000_000 + i))  # 'b' newest, whatever the clock's grain
    return ckpts


def test_load_of_a_directory_of_checkpoints_names_them_and_what_to_pass(tmp_path):
    """Before: the error listed the directory's entries without saying which are checkpoints or what
    to pass (only the CLI and the Trainer said it)."""
    ckpts = _dirpath_of_two(tmp_path)
    (ckpts / "notes.txt").write_text("x")
    with pytest.raises(IncompleteCheckpointError) as e:
        ldc.load({"w": _st("w", torch.empty(4, 4))}, str(ckpts))
    msg = str(e.value)
    assert f"{ckpts} is not a distributed checkpoint" in msg
    assert "it is a directory holding checkpoints (newest first: b, a)" in msg
    assert f"pass one of them, e.g. {ckpts / 'b'}" in msg
    assert msg.count("directory holding checkpoints") == 1


def test_command_line_names_the_checkpoints_in_a_directory_once(tmp_path):
    ckpts = _dirpath_of_two(tmp_path)
    r = subprocess.run([sys.executable, "-m", "lightning_distckpt", "inspect", str(ckpts)], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("it is a directory holding checkpoints (newest first: b, a)") == 1, r.stderr
    assert f"pass one of them, e.g. {ckpts / 'b'}" in r.stderr


def test_save_onto_a_file_says_a_checkpoint_is_a_directory(tmp_path):
    """Before: "exists and is not a directory; refusing to replace it", without what to do."""
    target = tmp_path / "model.pt"
    torch.save({"w": torch.ones(2)}, target)
    with pytest.raises(CheckpointingError) as e:
        ldc.save({"w": _st("w", torch.ones(4, 4))}, str(target))
    msg = str(e.value)
    assert str(target) in msg and "exists and is not a directory" in msg
    assert "move it away, or save elsewhere" in msg
    assert "a torch.save file, not a Trainer's (fabric.save's, a user's)" in msg  # what it is, why it stays
    assert torch.equal(torch.load(target)["w"], torch.ones(2))  # untouched


def test_the_other_first_mistakes_say_what_where_and_what_to_do(tmp_path):
    """Sound before: asserted so that their teaching parts stay."""
    ck = tmp_path / "ck"
    ldc.save({"w": _st("w", torch.ones(4, 4)), "step": 3}, str(ck))
    with pytest.raises(CheckpointNotFoundError) as e:  # a typo'd path: the committed ones beside it
        ldc.load({"w": _st("w", torch.empty(4, 4))}, str(tmp_path / "kc"))
    assert "no such directory" in str(e.value) and f"committed checkpoints in {tmp_path}" in str(e.value)
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(FormatError, match="notes.txt is not a checkpoint: neither a lightning_distckpt directory"):
        ldc.load({"w": _st("w", torch.empty(4, 4))}, str(tmp_path / "notes.txt"))
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x.txt").write_text("x")
    with pytest.raises(CheckpointingError, match=r"busy: directory exists, is not empty .* \(move its contents away"):
        ldc.save({"w": _st("w", torch.ones(4, 4))}, str(tmp_path / "busy"))
    with pytest.raises(MissingKeysError) as e:  # a renamed key under strict loading
        ldc.load({"weight": _st("weight", torch.empty(4, 4))}, str(ck))
    assert "'weight'" in str(e.value) and "strict=" in str(e.value)
    assert f"python -m lightning_distckpt inspect {ck}" in str(e.value)
    with pytest.raises(ShardingError, match=r"'w' has global shape \(4, 4\) in the checkpoint, \(4, 8\) in the tem"):
        ldc.load({"w": _st("w", torch.empty(4, 8))}, str(ck))
    with pytest.raises(CheckpointingError, match=r"cannot be serialized \(the value at 'f'\)"):
        ldc.save({"f": lambda x: x}, str(tmp_path / "lam"))
    # A torch.save file where a checkpoint is expected: read as it is, into the template.
    torch.save({"w": torch.arange(16.0).reshape(4, 4)}, tmp_path / "plain.pt")
    rows = torch.empty(2, 4)
    ldc.load({"w": ldc.ShardedTensor.from_rank_offsets("w", rows, (0, 1, 2))}, str(tmp_path / "plain.pt"))
    assert torch.equal(rows, torch.arange(8.0, 16.0).reshape(2, 4))


def test_finetune_example_without_transformers_says_what_to_install(tmp_path):
    """README's first install has no transformers; before: a ModuleNotFoundError traceback."""
    # Blocked once the example's imports ran: Lightning's torchmetrics imports transformers whenever its
    # distribution is installed, so a block from the start would fail there, not in the example.
    code = ("import runpy, sys; sys.path.insert(0, 'examples'); "
            "g = runpy.run_path('examples/finetune_llama_tp.py', run_name='example'); "
            "[sys.modules.pop(m) for m in list(sys.modules) if m.split('.')[0] == 'transformers']; "
            "sys.modules['transformers'] = None; "
            f"sys.argv = ['examples/finetune_llama_tp.py', '--dir', {str(tmp_path)!r}]; g['main']()")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    assert "builds its Llama with transformers" in r.stderr and 'pip install -e ".[test]"' in r.stderr
    docs = (ROOT / "docs" / "lightning.md").read_text()
    assert "(needs `transformers`, in the `test` extras" in docs
    assert "(needs `jsonargparse[signatures]`, in the `test` extras)" in docs


LOGGED = """
import logging, sys, torch
if sys.argv[1] == "configured":
    logging.basicConfig(level=logging.INFO)
import lightning_distckpt as ldc
ldc.save({"w": ldc.ShardedTensor.from_rank_offsets("w", torch.ones(64, 64))}, sys.argv[2])
ldc.load({"w": ldc.ShardedTensor.from_rank_offsets("w", torch.empty(64, 64))}, sys.argv[2])
"""


@pytest.mark.parametrize("mode", ["silent", "configured"])
def test_logging_as_docs_core_md_says(tmp_path, mode):
    """docs/core.md: silent in plain Python; with logging.basicConfig(level=INFO) one line per save and
    load with bytes, seconds and rate."""
    r = subprocess.run([sys.executable, "-c", LOGGED, mode, str(tmp_path / "ck")], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if "lightning_distckpt" in ln]
    if mode == "silent":
        assert lines == [], r.stderr
        return
    assert any(f"save {tmp_path / 'ck'}: " in ln and " s (" in ln and "B/s)" in ln for ln in lines), r.stderr
    assert any(f"load (two-stage) {tmp_path / 'ck'}: " in ln and "B/s)" in ln for ln in lines), r.stderr
