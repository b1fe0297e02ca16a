"""Claims that cost more than the bytes behind them, and nesting deeper than Python recurses, are
FormatErrors naming the file, raised quickly and with bounded memory.

* Trees: a ``torch.save`` file of shared lists nested 40 deep ("billion laughs": 2 KB, 2**40
  paths), the same structure as a checkpoint's ``common.pt`` (load, and ``convert --to dcp`` /
  ``--to torch`` through the console script), cycles, a torch file nested 5,000 deep. Tied
  weights (one tensor under two keys) and a dict shared by two keys still load under every name.
* Sizes: an even split over 2**20 ranks in a checkpoint saved by one; a global shape of
  1e11 x 1024 over one small shard; ``zeros(1).expand(10**12)`` in a torch file; a DCP
  ``.metadata`` claiming 10**12 elements (in a chunk, and in a tensor's size).
* JSON: a deeply nested safetensors header and Hugging Face index.
* The rank-0 API on 2 gloo processes: a file rank 0 cannot read (nested too deep) and a rank-0
  state dict that fails with a non-library error make every rank raise the same error within
  seconds, far below the group's timeout.

Operations that could hang or allocate run in a subprocess bounded at 60 s that reports its peak
resident memory (``resource.getrusage``).
"""

import contextlib
import hashlib
import io
import json
import os
import struct
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp

import lightning_distckpt as ldc
from dist_utils import run_distributed
from lightning_distckpt.core.errors import CheckpointingError, FormatError
from trust.hostile import edit_dcp_metadata, run_bounded

BOUND_S = 60
MODEST_MB = 1500  # python, torch and the library take about 400 MB; terabyte claims must not add to it

_RUNNER = r"""
import json, resource, sys, time
import lightning_distckpt as ldc
op, path = sys.argv[1], sys.argv[2]
t0 = time.perf_counter()
out = {"error": None, "message": ""}
try:
    if op == "plain":
        ldc.load_plain_tensors(path)
    elif op == "common":
        ldc.load_common_state_dict(path)
    elif op == "load":
        import torch
        ldc.load({"w": ldc.ShardedTensor.from_rank_offsets("w", torch.zeros(4))}, path)
except Exception as e:
    out["error"], out["message"] = type(e).__name__, str(e)
out["seconds"] = time.perf_counter() - t0
out["maxrss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps(out))
"""


def _bounded(op, path):
    """Run ``op`` on ``path`` in a fresh process (at most BOUND_S seconds); its report."""
    res = subprocess.run([sys.executable, "-c", _RUNNER, op, str(path)], capture_output=True, text=True,
                         timeout=BOUND_S)
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def _refused(op, path, *needles):
    out = _bounded(op, path)
    assert out["error"] == "FormatError", out
    assert all(n in out["message"] for n in needles), out["message"]
    assert out["maxrss_mb"] < MODEST_MB, out
    return out


def laughs(depth, leaf):
    """``a = [leaf, leaf]``, ``b = [a, a]``, ... ``depth`` levels: 2**depth paths, a few bytes each level."""
    x = [leaf, leaf]
    for _ in range(depth - 1):
        x = [x, x]
    return x


def nested(depth, leaf):
    x = leaf
    for _ in range(depth):
        x = [x]
    return x


def _save_deep(obj, path):
    """torch.save of a structure deeper than the default recursion limit allows to pickle."""
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(100_000)
    try:
        torch.save(obj, path)
    finally:
        sys.setrecursionlimit(limit)


def _checkpoint(tmp_path, name="ck"):
    ck = tmp_path / name
    ldc.save({"w": ldc.ShardedTensor.from_rank_offsets("w", torch.arange(4.0)), "step": 3}, ck)
    return ck


def _rewrite(ck, name, raw, field):
    (ck / name).write_bytes(raw)
    marker = json.loads((ck / "COMMITTED").read_text())  # self-consistent: the content is what is wrong
    marker[field] = hashlib.sha256(raw).hexdigest()
    (ck / "COMMITTED").write_text(json.dumps(marker))


def _edit_metadata(ck, fn):
    meta = json.loads((ck / "metadata.json").read_text())
    fn(meta)
    _rewrite(ck, "metadata.json", json.dumps(meta).encode(), "metadata_sha256")


def _common(ck, obj):
    path = str(ck / "common.pt.new")
    _save_deep(obj, path)
    with open(path, "rb") as f:
        raw = f.read()
    os.remove(path)
    _rewrite(ck, "common.pt", raw, "common_sha256")


# -------------------------------------------------------------------------------------- trees

def test_billion_laughs_torch_file_is_refused_quickly(tmp_path):
    path = tmp_path / "laughs.pt"
    torch.save({"w": torch.ones(2), "deep": laughs(40, torch.zeros(1))}, path)
    assert os.path.getsize(path) < 4096
    _refused("plain", path, str(path), "shared containers")
    with pytest.raises(FormatError, match="shared containers"):
        ldc.load({"w": ldc.ShardedTensor.from_rank_offsets("w", torch.zeros(2))}, path)


def test_billion_laughs_common_state_is_refused_by_load_and_convert(tmp_path):
    ck = _checkpoint(tmp_path)
    _common(ck, {"step": 3, "deep": laughs(40, 1)})
    _refused("common", ck, "common.pt", "shared containers")
    _refused("load", ck, "common.pt", "shared containers")
    for to in ("dcp", "torch"):
        code, err = _convert(ck, tmp_path / f"out_{to}", to)
        assert code == 2 and "Traceback" not in err, err[-2000:]
        assert "common.pt" in err and "shared containers" in err, err
        assert not os.path.exists(tmp_path / f"out_{to}")


def _convert(ck, out, to):
    """The ``convert`` command run by ``main()`` here (a hang bounded): its exit status and stderr."""
    from lightning_distckpt.cli.main import main

    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        got = run_bounded(lambda: main(["convert", str(ck), str(out), "--to", to]), BOUND_S)
    return got.get("value", got.get("error")), err.getvalue()


def test_deep_common_state_is_refused_by_convert_to_torch(tmp_path):
    ck = _checkpoint(tmp_path)
    _common(ck, {"step": 3, "deep": nested(5000, 1)})
    code, err = _convert(ck, tmp_path / "out.pt", "torch")
    assert code == 2 and "Traceback" not in err, err[-2000:]
    assert "common.pt" in err and "nested" in err and "100" in err, err
    assert not os.path.exists(tmp_path / "out.pt")


def test_cycles_are_refused(tmp_path):
    loop = [1]
    loop.append(loop)
    mutual = {"a": {}}
    mutual["a"]["b"] = mutual
    for name, obj in (("list", {"w": torch.ones(1), "loop": loop}), ("dict", {"w": torch.ones(1), "m": mutual})):
        path = tmp_path / f"{name}.pt"
        torch.save(obj, path)
        with pytest.raises(FormatError, match=r"contains itself \(a reference cycle\)") as err:
            ldc.load_plain_tensors(path)
        assert str(path) in str(err.value)
    ck = _checkpoint(tmp_path)
    _common(ck, {"loop": loop})
    with pytest.raises(FormatError, match="common.pt.*contains itself"):
        ldc.load_common_state_dict(ck)


def test_a_deep_torch_file_names_its_depth_and_file(tmp_path):
    path = tmp_path / "deep.pt"
    _save_deep({"w": torch.ones(2), "deep": nested(5000, torch.ones(1))}, path)
    _refused("plain", path, str(path), "nested more than 100 containers deep")
    from lightning_distckpt.ingest import load_state_dict

    with pytest.raises(FormatError, match="nested more than 100"):
        load_state_dict(path)


def test_tied_weights_and_shared_dicts_keep_every_name(tmp_path):
    tied = torch.arange(6.0).reshape(2, 3)
    sub = {"x": torch.ones(2), "n": 5}
    path = tmp_path / "tied.pt"
    torch.save({"embed.weight": tied, "lm_head.weight": tied, "model": sub, "ema": sub}, path)
    loaded = ldc.load_plain_tensors(path)
    assert set(loaded) == {"embed.weight", "lm_head.weight", "model/x", "ema/x"}
    assert torch.equal(loaded["embed.weight"], tied) and torch.equal(loaded["lm_head.weight"], tied)
    template = {k: ldc.ShardedTensor.from_rank_offsets(k, torch.zeros(2, 3))
                for k in ("embed.weight", "lm_head.weight")}
    out = ldc.load(template, path)
    assert torch.equal(out["embed.weight"], tied) and torch.equal(out["lm_head.weight"], tied)
    from lightning_distckpt.reading.formats.files import TorchFile

    common = TorchFile(str(path)).common  # the shared dict's other values, under both keys
    assert common["model"] == {"n": 5} and common["ema"] == {"n": 5}
    # one template tensor under two keys (tied in the model) is loaded at both
    ldc.save({"t": ldc.ShardedTensor.from_rank_offsets("t", torch.arange(4.0))}, tmp_path / "ck")
    both = ldc.ShardedTensor.from_rank_offsets("t", torch.zeros(4))
    back = ldc.load({"a": both, "b": both, "c": {"d": both}}, tmp_path / "ck")
    assert all(torch.equal(v, torch.arange(4.0)) for v in (back["a"], back["b"], back["c"]["d"]))


def test_the_walker_counts_places_without_expanding_and_stays_exact_within_bounds():
    """fold and walk_paths agree on what they refuse (small limits): a shared sub-tree counts at
    every place; fold builds it once and shares the result; walk_paths names every path."""
    from lightning_distckpt.core.tree_walk import Limits, check_tree, fold, walk_paths

    small = Limits(max_depth=5, min_places=40, sharing_factor=2, max_nodes=1000)
    shared = {"x": 1, "y": [2, 3]}
    tree = {"a": shared, "b": shared, "c": (shared, 4)}
    paths = walk_paths(tree, limits=small)
    assert [p for p, _ in paths] == [("a", "x"), ("a", "y", 0), ("a", "y", 1), ("b", "x"), ("b", "y", 0),
                                     ("b", "y", 1), ("c", 0, "x"), ("c", 0, "y", 0), ("c", 0, "y", 1), ("c", 1)]
    built = []
    copy = fold(tree, lambda v: v, lambda node, keys, results: built.append(node) or (
        dict(zip(keys, results)) if keys is not None else list(results)), limits=small)
    assert copy["a"] is copy["b"] is copy["c"][0] and sum(n is shared for n in built) == 1
    for refused in (laughs(6, 0), nested(6, 0)):
        with pytest.raises(FormatError):
            check_tree(refused, "t", limits=small)
        with pytest.raises(FormatError):
            walk_paths(refused, limits=small)
    check_tree(laughs(3, 0), "t", limits=small)  # 15 places from 5 stored: within max(40, 2 x 5)
    with pytest.raises(FormatError, match="more than 1000 containers and values"):
        check_tree(list(range(2000)), "t", limits=small)


# -------------------------------------------------------------------------------------- sizes

def _even_claim(over, world_size=None):
    def fn(meta):
        meta["tensors"]["w"] = {"global_shape": [over], "dtype": "float32", "even": {"over": over, "packed_from": 0}}
        if world_size is not None:
            meta["world_size"] = world_size
    return fn


def test_an_even_split_over_more_ranks_than_saved_is_refused(tmp_path):
    ck = _checkpoint(tmp_path)
    _edit_metadata(ck, _even_claim(1 << 20))
    _refused("plain", ck, "tensors['w'].even.over", "world_size 1")
    with pytest.raises(FormatError, match=r"at most the checkpoint's world_size 1"):
        ldc.load({"w": ldc.ShardedTensor.from_rank_offsets("w", torch.zeros(4))}, ck)
    # a world_size forged to match: no data/ holds a million rank stores
    forged = _checkpoint(tmp_path, "forged")
    _edit_metadata(forged, _even_claim(1 << 20, 1 << 20))
    _refused("plain", forged, "writer ranks", "rank stores")


def test_a_global_shape_its_shards_do_not_cover_is_not_allocated(tmp_path):
    ck = _checkpoint(tmp_path)

    def claim(meta):
        meta["tensors"]["w"]["global_shape"] = [10**11, 1024]
        shard = meta["tensors"]["w"]["shards"][0]
        shard["offset"], shard["shape"] = [0, 0], [1, 4]
    _edit_metadata(ck, claim)
    with pytest.raises(FormatError, match=r"'w' of global shape \[100000000000, 1024\]: rows \[0, 100000000000\) are "
                                          r"not stored"):
        ldc.load_plain_tensors(ck)
    _refused("plain", ck, "not stored")


def test_a_torch_view_claiming_a_terabyte_is_refused(tmp_path):
    path = tmp_path / "expand.pt"
    torch.save({"w": torch.zeros(1).expand(10**12), "ok": torch.arange(3).expand(2, 3)}, path)
    _refused("plain", path, "'w'", "4000000000000 bytes over 4 bytes stored")
    small = tmp_path / "small.pt"  # within the budget a view loads as it did
    torch.save({"v": torch.arange(3.0).expand(4, 3)}, small)
    assert torch.equal(ldc.load_plain_tensors(small)["v"], torch.arange(3.0).expand(4, 3))


def _dcp(tmp_path, name):
    path = str(tmp_path / name)
    dcp.save({"w": torch.arange(16.0)}, checkpoint_id=path, no_dist=True)
    return path


def test_dcp_metadata_claiming_a_trillion_elements_is_refused(tmp_path):
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    def both(meta):  # the tensor and its one chunk: the chunk's item holds 64 bytes
        entry = meta.state_dict_metadata["w"]
        entry.size = torch.Size([10**12])
        entry.chunks = [ChunkStorageMetadata(offsets=torch.Size([0]), sizes=torch.Size([10**12]))]

    def size_only(meta):  # the tensor claims 10**12, its chunk stays 16 elements
        meta.state_dict_metadata["w"].size = torch.Size([10**12])
    path = _dcp(tmp_path, "chunk")
    edit_dcp_metadata(path, both)
    _refused("plain", path, "claims 4000000000000 bytes", "holds")
    path = _dcp(tmp_path, "size")
    edit_dcp_metadata(path, size_only)
    _refused("plain", path, "rows [16, 1000000000000) are not stored")
    out = ldc.load({"w": ldc.ShardedTensor.from_offsets("w", torch.zeros(16), (10**12,), (0,))}, path)
    assert torch.equal(out["w"], torch.arange(16.0))  # a template reads the stored part


def test_a_dcp_metadata_memo_index_of_a_billion_allocates_nothing(tmp_path):
    """Nine bytes: ``None``, memoised at index 2**30, as the whole pickle. Python's C unpickler grows
    its memo array to twice the index (16 GiB, cleared); the file was found by the damage fuzz (one
    flipped byte of a real .metadata turned a string opcode into LONG_BINPUT)."""
    path = _dcp(tmp_path, "memo")
    with open(os.path.join(path, ".metadata"), "wb") as f:
        f.write(b"\x80\x02N" + b"r" + struct.pack("<I", 2**30) + b".")
    _refused("plain", path, ".metadata", "not a DCP Metadata record")


# -------------------------------------------------------------------------------------- JSON

def test_a_deep_safetensors_header_is_a_format_error(tmp_path):
    path = tmp_path / "deep.safetensors"
    header = ('{"__metadata__": {"x": ' + "[" * 100_000 + "]" * 100_000 + "}}").encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header)
    for read in (ldc.load_plain_tensors, ldc.load_tensors_metadata):
        with pytest.raises(FormatError, match="safetensors header: nested 100002 levels deep") as err:
            read(path)
        assert str(path) in str(err.value)


def test_a_deep_hugging_face_index_is_a_format_error(tmp_path):
    from safetensors.torch import save_file

    save_file({"w": torch.ones(2)}, tmp_path / "model-00001-of-00001.safetensors")
    index = tmp_path / "model.safetensors.index.json"
    index.write_text('{"weight_map": {"w": "model-00001-of-00001.safetensors"}, "metadata": '
                     + "[" * 50_000 + "]" * 50_000 + "}")
    with pytest.raises(FormatError, match="nested 50001 levels deep") as err:
        ldc.load_plain_tensors(tmp_path)
    assert str(index) in str(err.value)
    from lightning_distckpt.ingest import load_state_dict

    with pytest.raises(FormatError, match="nested 50001 levels deep"):
        load_state_dict(tmp_path)


# -------------------------------------------------------------------------------------- rank 0

def _rank0_reads(rank, world, path):
    """Every rank calls the rank-0 file reader; how long until it raised, and what."""
    from lightning_distckpt.ingest import load_state_dict

    t0 = time.perf_counter()
    try:
        load_state_dict(path)
    except CheckpointingError as e:
        return type(e).__name__, str(e), time.perf_counter() - t0
    return None, "", time.perf_counter() - t0


class _Exploding(dict):
    """Rank 0's state dict whose lookups fail with a non-library error (as a damaged lazy mapping would)."""

    def __contains__(self, key):
        raise RecursionError("maximum recursion depth exceeded while looking up 'w'")


def _rank0_state_fails(rank, world):
    from lightning_distckpt.ingest import broadcast_and_shard_state_dict, shard_broadcasted_state_dict

    meta = {"w": ldc.ShardedTensor.from_rank_offsets("w", torch.zeros(2), (0, rank, world))}
    out = {}
    t0 = time.perf_counter()
    try:
        if rank == 0:
            broadcast_and_shard_state_dict(_Exploding(w=torch.arange(4.0)), meta, out)
        else:
            shard_broadcasted_state_dict(meta, out)
    except CheckpointingError as e:
        return type(e).__name__, str(e), time.perf_counter() - t0
    return None, "", time.perf_counter() - t0


def test_rank0_failures_reach_every_rank_promptly(tmp_path):
    path = str(tmp_path / "deep.pt")
    _save_deep({"w": torch.ones(2), "deep": nested(5000, 1)}, path)
    timeout = 600  # the group's collective timeout: the ranks must not wait for it
    results = run_distributed(_rank0_reads, 2, path, timeout_s=timeout)
    assert results[0][:2] == results[1][:2], results
    assert results[0][0] == "FormatError" and "nested more than 100" in results[0][1] and path in results[0][1]
    assert all(seconds < timeout / 2 for _, _, seconds in results), results  # not the collective timeout
    results = run_distributed(_rank0_state_fails, 2, timeout_s=timeout)
    assert results[0][:2] == results[1][:2], results
    assert results[0][0] == "CheckpointingError" and "RecursionError" in results[0][1]
    assert all(seconds < timeout / 2 for _, _, seconds in results), results  # not the collective timeout
