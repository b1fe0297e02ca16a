"""A metadata.json whose ``world_size`` is forged together with its even splits is refused when the
checkpoint is opened, before anything is sized by the claimed ranks.

An even dim-0 split (``planning/even_index.py``) is one index entry whatever the number of ranks:
``{"even": {"over": N}}`` stands for N stored chunks, chunk i in rank i's store. ``over`` is bounded
by the ``world_size`` field, but both are only words in a file: a few hundred bytes claiming
2**20 ranks made a reader build per-rank arrays and dicts (about 2.4 s and 0.9 GB) before the
store count refused it. The reader now counts ``data/``'s rank stores when it opens a local
checkpoint and the parse refuses a split with more chunks than stores, naming the file and the field.

Peak memory is measured in a fresh process (``resource.getrusage``), bounded at 60 s, against the
same process opening the unforged checkpoint; nothing here depends on the machine's speed.
"""

import hashlib
import json
import shutil
import subprocess
import sys

import pytest
import torch

import lightning_distckpt as ldc
from lightning_distckpt.planning.even_index import chunks_bound
from lightning_distckpt.core.errors import CheckpointingError
from dist_utils import run_distributed
from lightning_distckpt.core.errors import FormatError
from lightning_distckpt.reading.checkpoint import OpenedCheckpoint

BOUND_S = 60
EXTRA_MB = 64  # what a refused forgery may add to the peak over opening the honest checkpoint

_RUNNER = r"""
import json, resource, sys
import torch
import lightning_distckpt as ldc
from lightning_distckpt.reading.checkpoint import OpenedCheckpoint
path, outs = sys.argv[1], {}
for op in ("open", "plain", "load"):
    out = outs[op] = {"error": None, "message": ""}
    try:
        if op == "open":
            OpenedCheckpoint.open(path)
        elif op == "plain":
            ldc.load_plain_tensors(path)
        else:
            ldc.load({"w": ldc.ShardedTensor.from_rank_offsets("w", torch.zeros(4))}, path)
    except Exception as e:
        out["error"], out["message"] = type(e).__name__, str(e)
print(json.dumps({"ops": outs, "maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def _bounded(path):
    """Open, load whole and load into a template ``path`` in a fresh process (at most BOUND_S
    seconds): each one's error, and the process's peak resident memory."""
    res = subprocess.run([sys.executable, "-c", _RUNNER, str(path)], capture_output=True, text=True, timeout=BOUND_S)
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def _checkpoint(path):
    ldc.save({"w": ldc.ShardedTensor.from_rank_offsets("w", torch.arange(4.0)), "step": 3}, path)
    return path


def _forge(ck, keys, over):
    """metadata.json claiming ``keys`` float32 tensors of ``over`` rows, each an even split over
    ``over`` ranks, and ``world_size`` = ``over``; the commit marker made to match it."""
    meta = json.loads((ck / "metadata.json").read_text())
    for i in range(keys):
        meta["tensors"][f"w{i}"] = {"global_shape": [over], "dtype": "float32",
                                    "even": {"over": over, "packed_from": 0}}
    meta["world_size"] = over
    raw = json.dumps(meta).encode()
    (ck / "metadata.json").write_bytes(raw)
    marker = json.loads((ck / "COMMITTED").read_text())
    marker["metadata_sha256"] = hashlib.sha256(raw).hexdigest()
    (ck / "COMMITTED").write_text(json.dumps(marker))


def test_a_forged_world_size_is_refused_at_open_with_no_memory_to_speak_of(tmp_path):
    honest = _checkpoint(tmp_path / "honest")
    forged = _checkpoint(tmp_path / "forged")
    _forge(forged, 64, 1 << 20)  # 64 x 2**20 chunks: the most an index may claim (MAX_CHUNKS)
    base, out = _bounded(honest), _bounded(forged)
    assert all(o["error"] is None for o in base["ops"].values()), base
    for op, o in out["ops"].items():
        assert o["error"] == "FormatError", (op, o)
        for needle in (f"checkpoint {forged}", "metadata.json field tensors['w0'].even.over 1048576",
                       "field world_size: 1048576", "1048576 chunks", "data/ holds 1 rank stores"):
            assert needle in o["message"], (op, o["message"])
    assert out["maxrss_mb"] < base["maxrss_mb"] + EXTRA_MB, (out, base)


def test_the_refusal_comes_from_opening_the_index(tmp_path):
    ck = _checkpoint(tmp_path / "ck")
    _forge(ck, 1, 1 << 20)
    with pytest.raises(FormatError, match=r"even\.over 1048576 \(field world_size: 1048576\) puts 1048576 chunks"):
        OpenedCheckpoint.open(ck)
    # a split no wider than the stores is not this check's business (packed_from still is)
    ok = _checkpoint(tmp_path / "ok")
    _forge(ok, 1, 1)
    assert OpenedCheckpoint.open(ok).index.tensors["w0"].even.over == 1


def _save_even(rank, world_size, path):
    """Each rank saves its chunk of an even dim-0 split (FSDP-like): one ``even`` index entry."""
    rows = torch.arange(24.0).reshape(8, 3)
    chunk = rows.chunk(world_size)[rank].clone()
    ldc.save({"w": ldc.ShardedTensor.from_rank_offsets("w", chunk, (0, rank, world_size))}, path)


def test_an_even_split_of_two_ranks_loads_and_a_lost_rank_store_is_named_as_missing(tmp_path):
    ck = tmp_path / "even"
    run_distributed(_save_even, 2, str(ck))
    meta = json.loads((ck / "metadata.json").read_text())
    assert meta["tensors"]["w"]["even"]["over"] == 2 and meta["world_size"] == 2
    assert torch.equal(ldc.load_plain_tensors(ck)["w"], torch.arange(24.0).reshape(8, 3))
    shutil.rmtree(ck / "data" / "rank_00001")  # the store holding chunk 1: damage, not a forged claim
    assert OpenedCheckpoint.open(ck).index.tensors["w"].even.over == 2
    with pytest.raises(CheckpointingError, match=r"2 writer ranks holding tensor data, but data/ holds 1 rank stores"):
        ldc.load_plain_tensors(ck)
    report = ldc.validate(ck)
    assert not report.ok and any("rank 1" in p and "missing" in p for p in report.problems), report.problems
    # many more chunks than the stores could hold is the forged claim, refused at open
    assert chunks_bound(1) < 1048576
