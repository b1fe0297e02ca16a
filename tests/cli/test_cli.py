"""The command line (``python -m lightning_distckpt`` / ``lightning-distckpt``: each once as a subprocess,
the rest through ``main()`` in this process) on checkpoints written by a real 2-process gloo save, on
damaged copies of them and on directories that are no checkpoint."""

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

import lightning_distckpt as ldc
from dist_utils import run_distributed

FULL = torch.arange(64 * 25, dtype=torch.float32).reshape(64, 25)  # 100-byte rows: 10 rows per 1 KiB chunk
NORM = torch.linspace(0, 1, 6).to(torch.bfloat16)


def _save_tp2(rank, world, path, layout):
    """TP=2 split of a matrix, a replicated norm, a flattened optimizer state, objects, common state."""
    rows = FULL.shape[0] // world
    flat = FULL.reshape(-1)
    n = flat.numel() // world
    sd = {
        "layer.weight": ldc.ShardedTensor.from_rank_offsets(
            "layer.weight", FULL[rank * rows:(rank + 1) * rows].clone(), (0, rank, world)),
        "layer.norm": ldc.ShardedTensor.from_rank_offsets("layer.norm", NORM.clone(), replica_id=rank),
        "optim.exp_avg": ldc.ShardedTensor.from_rank_offsets_flat(
            "optim.exp_avg", flat[rank * n:(rank + 1) * n].clone() * 2, (64, 25),
            flattened_range=slice(rank * n, (rank + 1) * n)),
        "rng": ldc.ShardedObject("rng", {"rank": rank, "seed": 1234 + rank}, (world,), (rank,)),
        "step": 17,
        "hparams": {"lr": 0.1, "name": "gpt"},
    }
    # pack_max_bytes: the norm (12 bytes) is packed, the weight halves (3.2 KiB) are arrays of 1 KiB chunks
    ldc.save(sd, path, storage=ldc.StorageOptions(layout=layout, chunk_bytes=1024, pack_max_bytes=1024))
    return True


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """One checkpoint per layout, written once by 2 gloo processes; tests copy before damaging."""
    root = tmp_path_factory.mktemp("cli")
    out = {}
    for layout in ("ocdbt", "zarr"):
        path = str(root / layout)
        run_distributed(_save_tp2, 2, path, layout)
        out[layout] = path
    return out


def cli(*args, exe=None, module=False):
    """The command's exit status and output: run by ``main()`` in this process (as a program that
    embeds it would; an interpreter start with torch costs ~3 s a call), or as a subprocess through
    the console script ``exe`` or, with ``module``, ``python -m lightning_distckpt``."""
    argv = [str(a) for a in args]
    if exe or module:
        cmd = [exe] if exe else [sys.executable, "-m", "lightning_distckpt"]
        return subprocess.run(cmd + argv, capture_output=True, text=True, timeout=120)
    from lightning_distckpt.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as e:  # argparse's usage errors
            code = e.code
    return subprocess.CompletedProcess(argv, code, out.getvalue(), err.getvalue())


def damaged_copy(src, tmp_path, name="ck"):
    dst = str(tmp_path / name)
    shutil.copytree(src, dst)
    return dst


def data_files(path, rank):
    root = os.path.join(path, "data", f"rank_{rank:05d}")
    return sorted((os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs), key=os.path.getsize)


def test_inspect_table(saved):
    r = cli("inspect", saved["ocdbt"])
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "committed (complete)" in out
    assert "on 2 rank(s)" in out and "ocdbt" in out
    lines = {ln.split()[0]: ln for ln in out.splitlines() if ln.startswith(("layer.", "optim.", "rng"))}
    assert "(64, 25)" in lines["layer.weight"] and "float32" in lines["layer.weight"]
    assert "2x1" in lines["layer.weight"] and "axis 0 at 0,32" in lines["layer.weight"]
    assert "0-1" in lines["layer.weight"]  # both ranks wrote a half
    assert "bfloat16" in lines["layer.norm"] and "(6,)" in lines["layer.norm"] and "whole" in lines["layer.norm"]
    assert "2 flattened piece(s)" in lines["optim.exp_avg"]
    assert "6.2 KiB" in lines["layer.weight"]  # 64*25*4 bytes
    assert lines["rng"].split()[1:] == ["(2,)", "2", "0-1"]


def test_inspect_json_matches_metadata(saved):
    r = cli("inspect", saved["zarr"], "--json")
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)
    with open(os.path.join(saved["zarr"], "metadata.json")) as f:
        meta = json.load(f)
    assert s["committed"] is True and s["world_size"] == 2 and s["storage"]["layout"] == "zarr"
    by_key = {t["key"]: t for t in s["tensors"]}
    assert set(by_key) == set(meta["tensors"])
    w = by_key["layer.weight"]
    assert w["shape"] == [64, 25] and w["grid"] == [2, 1] and w["writers"] == [0, 1] and w["bytes"] == 64 * 25 * 4
    assert by_key["layer.norm"]["shards"] == 1 and by_key["layer.norm"]["dtype"] == "bfloat16"
    assert s["data_files"] > 0 and s["common_bytes"] > 0
    # 2 weight halves + 2 flat pieces as arrays of their own; the norm packed in its writer's bf16 pack
    assert s["packed_shards"] == 1 and s["stored_arrays"] == 5 and by_key["layer.norm"]["packed"] == 1


@pytest.mark.parametrize("layout", ["ocdbt", "zarr"])
def test_validate_intact(saved, layout):
    r = cli("validate", saved[layout], module=layout == "ocdbt")  # python -m lightning_distckpt once
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip().splitlines()[-1].startswith("OK: ")
    report = json.loads(cli("validate", saved[layout], "--json").stdout)
    assert report["ok"] and report["problems"] == [] and report["objects"] == 2
    # weight halves: 32 rows = 4 chunks of <= 10 rows each; flat halves: 800 floats = 4 chunks of <= 256
    assert report["shards"] == 5 and report["chunks"] == 2 * 4 + 1 + 2 * 4


def test_validate_deleted_ocdbt_data_file(saved, tmp_path):
    path = damaged_copy(saved["ocdbt"], tmp_path)
    victim = data_files(path, 1)[-1]  # rank 1's largest file: its array data
    os.remove(victim)
    r = cli("validate", path)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "DAMAGED" in r.stdout and "(rank 1)" in r.stdout
    assert "Traceback" not in r.stdout + r.stderr
    # loading the same checkpoint fails loudly, naming the checkpoint
    with pytest.raises(ldc.CheckpointingError, match="rank 1"):
        ldc.load_plain_tensors(path)


def test_validate_truncated_data_file(saved, tmp_path):
    path = damaged_copy(saved["ocdbt"], tmp_path)
    victim = data_files(path, 0)[-1]
    os.truncate(victim, os.path.getsize(victim) // 2)
    r = cli("validate", path, "--json")
    assert r.returncode == 1
    report = json.loads(r.stdout)
    assert not report["ok"] and any("rank 0" in p for p in report["problems"])


def test_validate_missing_zarr_chunk_is_not_read_as_zeros(saved, tmp_path):
    path = damaged_copy(saved["zarr"], tmp_path)
    chunk = [f for f in data_files(path, 1) if "layer.weight" in f and f.endswith(os.path.join("c", "1", "0"))]
    assert chunk, data_files(path, 1)
    os.remove(chunk[0])
    r = cli("validate", path)
    assert r.returncode == 1
    assert "'layer.weight' shard" in r.stdout and "rows 8:16" in r.stdout  # 8-row chunks: the 2nd is gone
    with pytest.raises(ldc.CheckpointingError, match="layer.weight"):
        ldc.load_plain_tensors(path)  # a missing chunk must never come back as zeros


def test_validate_names_the_shards_of_a_missing_pack_array(saved, tmp_path):
    path = damaged_copy(saved["zarr"], tmp_path)
    with open(os.path.join(path, "metadata.json")) as f:
        norm = json.load(f)["tensors"]["layer.norm"]["shards"][0]
    assert norm["packed"] == 0  # the replicated bf16 norm is the only small shard: alone in its pack
    shutil.rmtree(os.path.join(path, "data", f"rank_{norm['writer']:05d}", "p", "bfloat16"))
    r = cli("validate", path)
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"'layer.norm' shard 0 (rank {norm['writer']}, packed): cannot open" in r.stdout
    assert "'layer.weight'" not in r.stdout  # the arrays of their own are intact
    with pytest.raises(ldc.CheckpointingError, match="layer.norm"):
        ldc.load_plain_tensors(path)


def test_validate_truncated_common_state(saved, tmp_path):
    path = damaged_copy(saved["ocdbt"], tmp_path)
    common = os.path.join(path, "common.pt")
    os.truncate(common, os.path.getsize(common) - 40)
    r = cli("validate", path)
    assert r.returncode == 1
    assert "common state" in r.stdout and "PROBLEM" in r.stdout


def test_validate_missing_rank_directory(saved, tmp_path):
    path = damaged_copy(saved["zarr"], tmp_path)
    shutil.rmtree(os.path.join(path, "data", "rank_00001"))
    r = cli("validate", path)
    assert r.returncode == 1
    assert "rank 1: data directory" in r.stdout and "missing" in r.stdout


@pytest.mark.parametrize("command", ["inspect", "validate"])
def test_not_a_checkpoint(tmp_path, command, capsys):
    (tmp_path / "notes.txt").write_text("hello")
    r = cli(command, tmp_path)
    assert r.returncode == 2
    assert "not a lightning_distckpt checkpoint" in r.stderr
    assert "Traceback" not in r.stderr
    # the other bad paths in-process (same entry point, no interpreter start-up per case)
    from lightning_distckpt.cli import main

    assert main([command, str(tmp_path / "notes.txt")]) == 2  # inspect reads tensor files: says what this is
    assert ("is a file" if command == "validate" else "neither a lightning_distckpt directory nor a torch / "
            "safetensors file (text: it starts with 'hello')") in capsys.readouterr().err
    assert main([command, str(tmp_path / "absent")]) == 2
    assert "no such directory" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["inspect", "validate"])
def test_incomplete_checkpoint(saved, tmp_path, command):
    path = damaged_copy(saved["ocdbt"], tmp_path)
    os.remove(os.path.join(path, "COMMITTED"))
    r = cli(command, path)
    assert r.returncode == 2
    assert "incomplete checkpoint" in r.stderr and "Traceback" not in r.stderr


def test_console_script_and_usage(saved):
    exe = os.path.join(os.path.dirname(sys.executable), "lightning-distckpt")
    assert os.path.exists(exe), "console script not installed: pip install -e ."
    r = cli("inspect", saved["ocdbt"], exe=exe)
    assert r.returncode == 0 and "layer.weight" in r.stdout
    r = cli(exe=exe)  # no arguments: the whole help (each command and the exit statuses), not one usage line
    assert r.returncode == 2 and "inspect" in r.stderr and "validate" in r.stderr
    assert "show keys, global shapes" in r.stderr and "exit status: 0 ok" in r.stderr


def test_format_doc_snippet(saved):
    """The "open a stored shard with plain tensorstore" snippet of docs/format.md works as written."""
    import re

    import numpy as np

    doc = open(os.path.join(os.path.dirname(__file__), "..", "..", "docs", "format.md")).read()
    snippet = re.search(r"## Opening a stored shard.*?```python\n(.*?)```", doc, re.S).group(1)
    for layout in ("ocdbt", "zarr"):
        scope = {"CKPT": saved[layout], "KEY": "layer.weight"}
        exec(snippet, scope)
        shard = scope["shard"]
        rows = slice(shard["offset"][0], shard["offset"][0] + shard["shape"][0])
        np.testing.assert_array_equal(scope["data"], FULL[rows].numpy())
        scope = {"CKPT": saved[layout], "KEY": "layer.norm"}  # a packed shard
        exec(snippet, scope)
        assert scope["packed"] is not None
        np.testing.assert_array_equal(scope["data"], NORM.view(torch.int16).numpy().view(scope["data"].dtype))
