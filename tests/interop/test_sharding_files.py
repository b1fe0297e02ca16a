"""lightning_distckpt.ingest.load_state_dict: torch, safetensors and Hugging Face files (built here
with transformers, nothing downloaded), device maps, and bad input refused before any large
allocation."""

import json
import os
import struct

import pytest
import safetensors.torch
import torch

import lightning_distckpt as ldc
from dist_utils import run_distributed
from hf_helpers import tiny_llama
from lightning_distckpt.core.errors import ArgumentError, FormatError, UnsafeContentError
from lightning_distckpt.ingest import (
    CheckpointStateDict, broadcast_and_shard_state_dict, load_state_dict, shard_broadcasted_state_dict,
)


def _state():
    g = torch.Generator().manual_seed(1)
    return {"a.weight": torch.randn(5, 4, generator=g), "a.bias": torch.randn(5, generator=g),
            "b.weight": torch.randn(3, 5, generator=g).to(torch.bfloat16), "step": torch.tensor(7)}


def _is_file_mapped(t: torch.Tensor, path: str) -> bool:
    ptr = t.untyped_storage().data_ptr()
    for line in open("/proc/self/maps"):
        parts = line.split()
        lo, hi = (int(v, 16) for v in parts[0].split("-"))
        if lo <= ptr < hi:
            return parts[-1] == os.path.realpath(path)
    return False


@pytest.mark.parametrize("kind", ["pt", "safetensors"])
def test_reads_memory_mapped(tmp_path, kind):
    state = _state()
    path = str(tmp_path / f"m.{kind}")
    torch.save(state, path) if kind == "pt" else safetensors.torch.save_file(state, path)
    sd = load_state_dict(path)
    assert isinstance(sd, CheckpointStateDict) and sd.source == path and set(sd.files.values()) == {path}
    assert sorted(sd) == sorted(state)
    for k, v in state.items():
        assert torch.equal(sd[k], v) and sd[k].dtype == v.dtype
    assert _is_file_mapped(sd["a.weight"], path)


def test_legacy_torch_format(tmp_path):
    """Files of the pre-zip format (torch < 1.6) cannot be memory-mapped: read whole."""
    path = str(tmp_path / "legacy.pt")
    torch.save(_state(), path, _use_new_zipfile_serialization=False)
    sd = load_state_dict(path)
    assert all(torch.equal(sd[k], v) for k, v in _state().items())


def test_device_map(tmp_path):
    path = str(tmp_path / "m.pt")
    torch.save(_state(), path)
    assert all(t.device.type == "cpu" for t in load_state_dict(path, device_map="cpu").values())
    sd = load_state_dict(path, device_map={"a": "cpu", "": torch.device("cpu")})
    assert sorted(sd) == sorted(_state())
    with pytest.raises(ArgumentError, match="'step'"):
        load_state_dict(path, device_map={"a": "cpu", "b": "cpu"})
    with pytest.raises(ArgumentError, match="meta device"):
        load_state_dict(path, device_map="meta")


# -- Hugging Face directories ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def llama_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("llama")
    model = tiny_llama()
    dirs = {}
    for name, kwargs in {"sharded_st": dict(max_shard_size="20KB"), "single_st": {}}.items():
        dirs[name] = str(root / name)
        model.save_pretrained(dirs[name], **kwargs)
    dirs["sharded_bin"] = _as_bin_layout(dirs["sharded_st"], str(root / "sharded_bin"))
    expected = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return dirs, expected


def _as_bin_layout(st_dir, out_dir):
    """The ``pytorch_model.bin`` layout transformers < 5 wrote (5 writes safetensors only): the
    same shards as ``torch.save`` files and a ``pytorch_model.bin.index.json``."""
    os.makedirs(out_dir)
    weight_map = {}
    for f in sorted(os.listdir(st_dir)):
        if f.endswith(".safetensors"):
            name = f.replace("model-", "pytorch_model-").replace(".safetensors", ".bin")
            shard = safetensors.torch.load_file(os.path.join(st_dir, f))
            torch.save(shard, os.path.join(out_dir, name))
            weight_map.update(dict.fromkeys(shard, name))
    with open(os.path.join(out_dir, "pytorch_model.bin.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return out_dir


def test_hugging_face_directories(llama_dirs):
    dirs, expected = llama_dirs
    assert os.path.exists(os.path.join(dirs["sharded_st"], "model.safetensors.index.json"))
    assert os.path.exists(os.path.join(dirs["sharded_bin"], "pytorch_model.bin.index.json"))
    for name, d in dirs.items():
        sd = load_state_dict(d)
        files = set(sd.files.values())
        assert len(files) > (1 if name.startswith("sharded") else 0), name
        for k, v in sd.items():
            assert torch.equal(v, expected[k]), (name, k)
        assert set(expected) - set(sd) <= {"lm_head.weight"}  # tied embeddings are saved once


def _tp_from_hf(rank, world, directory):
    """Column-split q/k/v/gate/up, row-split o/down, everything else whole, from a sharded HF dir."""
    ST = ldc.ShardedTensor
    want_all = {}
    for f in sorted(os.listdir(directory)):
        if f.endswith(".safetensors"):
            want_all.update(safetensors.torch.load_file(os.path.join(directory, f)))
    entries, expected = {}, {}
    for key, t in want_all.items():
        axis = 0 if any(p in key for p in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")) else \
            1 if any(p in key for p in ("o_proj", "down_proj")) else None
        meta = torch.empty(t.shape, dtype=t.dtype, device="meta")
        if axis is None:
            entries[key], expected[key] = ST.from_rank_offsets(key, meta, replica_id=rank), t
        else:
            local = meta.chunk(world, axis)[rank]
            entries[key] = ST.from_rank_offsets(key, local, (axis, rank, world))
            expected[key] = t.chunk(world, axis)[rank]
    sd = load_state_dict(directory)
    out = {}
    if rank == 0:
        broadcast_and_shard_state_dict(sd, entries, out, bucket_bytes=4096)
    else:
        shard_broadcasted_state_dict(entries, out, bucket_bytes=4096)
    return all(torch.equal(out[k], v) for k, v in expected.items()) and sorted(out) == sorted(expected)


def test_hugging_face_sharded_into_tp(llama_dirs):
    assert run_distributed(_tp_from_hf, 2, llama_dirs[0]["sharded_st"]) == [True, True]


def test_hugging_face_index_errors(tmp_path):
    d = tmp_path / "hf"
    d.mkdir()
    safetensors.torch.save_file({"x": torch.ones(2)}, str(d / "part.safetensors"))
    index = d / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"x": "part.safetensors", "y": "part.safetensors"}}))
    with pytest.raises(FormatError, match="'y'.*part.safetensors|part.safetensors.*'y'"):
        load_state_dict(str(d))
    index.write_text(json.dumps({"weight_map": {"x": "../elsewhere.safetensors"}}))
    with pytest.raises(FormatError, match="not a file name"):
        load_state_dict(str(d))
    index.write_text("{not json")
    with pytest.raises(FormatError, match="index"):
        load_state_dict(str(d))
    os.remove(index)
    with pytest.raises(FormatError, match="not a Hugging Face model directory"):
        load_state_dict(str(d))


# -- bad safetensors files ----------------------------------------------------------------------
def _write_safetensors(path, header, data_bytes):
    raw = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + b"\0" * data_bytes)
    return str(path)


def _refused(path, *words):
    with pytest.raises(FormatError) as info:
        load_state_dict(path)
    for w in (path, *words):
        assert w in str(info.value), (w, str(info.value))


def test_bad_safetensors(tmp_path):
    good = str(tmp_path / "good.safetensors")
    safetensors.torch.save_file({"w": torch.randn(64, 64)}, good)
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(open(good, "rb").read()[:-100])
    _refused(str(truncated), "'w'", "past the end")
    tiny = tmp_path / "tiny.safetensors"
    tiny.write_bytes(b"\x01\x02")
    _refused(str(tiny), "8-byte")
    # A header length of 2**60 must be refused from the file size, not allocated.
    huge = tmp_path / "huge.safetensors"
    huge.write_bytes(struct.pack("<Q", 1 << 60) + b"{}")
    _refused(str(huge), "header length")
    entry = {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}
    _refused(_write_safetensors(tmp_path / "past.safetensors", {"w": {**entry, "data_offsets": [16, 32]}}, 16),
             "'w'", "past the end")
    _refused(_write_safetensors(tmp_path / "overlap.safetensors",
                                {"a": entry, "b": {**entry, "data_offsets": [8, 24]}}, 32), "overlaps")
    _refused(_write_safetensors(tmp_path / "dtype.safetensors", {"w": {**entry, "dtype": "F128"}}, 16),
             "'w'", "unknown dtype 'F128'")
    _refused(_write_safetensors(tmp_path / "size.safetensors", {"w": {**entry, "data_offsets": [0, 12]}}, 16),
             "'w'", "needs 16")
    _refused(_write_safetensors(tmp_path / "shape.safetensors", {"w": {**entry, "shape": [-4]}}, 16), "'w'", "shape")
    notjson = tmp_path / "notjson.safetensors"
    notjson.write_bytes(struct.pack("<Q", 5) + b"{oops")
    _refused(str(notjson), "JSON")


# -- bad torch files ------------------------------------------------------------------------------
class RunsCode:
    def __reduce__(self):
        return (os.system, ("echo this must never run",))


def test_bad_torch_files(tmp_path):
    evil = str(tmp_path / "evil.pt")
    torch.save({"w": torch.ones(2), "payload": RunsCode()}, evil)
    with pytest.raises(UnsafeContentError, match="evil.pt"):
        load_state_dict(evil)
    good = str(tmp_path / "good.pt")
    torch.save({"w": torch.randn(256, 256)}, good)
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(open(good, "rb").read()[:-4096])
    _refused(str(truncated), "torch.save archive")
    nested = str(tmp_path / "nested.pt")
    torch.save({"state_dict": {"w": torch.ones(2)}, "epoch": 3}, nested)
    _refused(nested, "'state_dict'")
    listing = str(tmp_path / "list.pt")
    torch.save([torch.ones(2)], listing)
    _refused(listing, "list")
    _refused(str(tmp_path / "absent.pt"), "no such file")
