"""The examples run end to end with one command each (train on 2 processes, resume on 1 and 4).
examples/cli_gpt.py (the YAML-configured run) is exercised in test_config.py."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[2]


def _run(script, out_dir):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    for var in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "GLOBAL_RANK", "MASTER_PORT", "MASTER_ADDR"):
        env.pop(var, None)
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / script), "--dir", str(out_dir)], env=env,
                          capture_output=True, text=True, timeout=480)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-6000:]
    with open(out_dir / "summary.json") as f:
        return proc.stdout, json.load(f)


@pytest.mark.slow
def test_trainer_example(tmp_path):
    stdout, summary = _run("train_gpt_tp.py", tmp_path)
    assert all(summary["checks"].values()), summary["checks"]
    runs = summary["runs"]
    assert runs["train"]["parallel"].endswith("tp 0/2, dp 0/1")
    assert runs["resume_tp1"]["parallel"].endswith("tp 0/1, dp 0/1")
    assert runs["resume_tp2_dp2"]["parallel"].endswith("tp 0/2, dp 0/2")
    assert sorted(runs["resume_tp1"]["losses"], key=int) == ["8", "9", "10", "11"]
    assert max(summary["worst_relative_diff"].values()) <= 1e-4
    # The printed report shows the sharded layout and the throughput of every save and load.
    assert "gpt.blocks.0.fc1.weight: global (256, 64) stored as (128, 64)@(0, 0) by rank 0" in stdout
    assert stdout.count("save ") >= 6 and "load" in stdout
    ckdir = tmp_path / "checkpoints"
    assert sorted(os.listdir(ckdir)) == ["last.ckpt", "step=12.ckpt", "step=4.ckpt", "step=8.ckpt"]


@pytest.mark.long  # the Fabric loop is run in CI by tests/docs/test_readme.py (examples/readme/fabric.py)
def test_fabric_example(tmp_path):
    stdout, summary = _run("fabric_gpt_tp.py", tmp_path)
    assert summary["ok"] is True and stdout.rstrip().endswith("OK")
    assert max(summary["worst_relative_diff"].values()) <= 1e-4
    assert sorted(summary["runs"]["resume_tp2_dp2"]["losses"], key=int) == ["8", "9", "10", "11"]
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step=12", "step=4", "step=8"]


def test_finetune_llama_example(tmp_path):
    """A tiny transformers Llama saved locally with save_pretrained(max_shard_size=...), its MLP loaded
    into TP 2 layers with load_module_weights(key_map=...) and fine-tuned on 2 processes; the step-0
    loss equals the un-sharded (TP 1) module's from the same files."""
    pytest.importorskip("transformers")
    stdout, summary = _run("finetune_llama_tp.py", tmp_path)
    assert all(summary["checks"].values()), summary["checks"]
    assert summary["parallel"].endswith("tp 0/2, dp 0/1")
    assert (tmp_path / "llama" / "model.safetensors.index.json").is_file()
    assert stdout.rstrip().endswith("OK")
