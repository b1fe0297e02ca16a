"""Export to Hugging Face safetensors and to PyTorch DCP (lightning_distckpt.export), read back by
the real peers: transformers' ``from_pretrained``, ``safetensors.torch.load_file``,
``torch.distributed.checkpoint.load`` under a DTensor split on 2 gloo ranks, and ``ldc.load``."""

from __future__ import annotations

import json
import os

import pytest
import torch

import lightning_distckpt as ldc
from lightning_distckpt.cli.main import main as cli_main
from lightning_distckpt.core.errors import ArgumentError
from lightning_distckpt.export import dcp_out, safetensors_out
from lightning_distckpt.export.safetensors_out import (INDEX_FILE, SINGLE_FILE, ShardFile, assign_files, parse_size,
                                                      plan_files)
from lightning_distckpt.export.tensors import ExportTensor

from dist_utils import run_distributed

# Megatron-style tensor-parallel axes of a Llama block: column-parallel split axis 0, row-parallel axis 1.
_COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "embed_tokens", "lm_head")
_ROW = ("o_proj", "down_proj")


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    return config, LlamaForCausalLM(config).eval()


def _tp_axis(name: str):
    if any(p in name for p in _COLUMN):
        return 0
    if any(p in name for p in _ROW):
        return 1
    return None


def _save_tp_and_export(rank: int, world: int, weights_file: str, ckpt: str, out: str, max_shard: int):
    sd = torch.load(weights_file, weights_only=True)
    sharded = {}
    for name, t in sd.items():
        axis = _tp_axis(name)
        if axis is None:  # norms: replicated, rank 0's copy is main
            sharded[name] = ldc.ShardedTensor.from_rank_offsets(name, t.clone(), replica_id=rank)
        else:
            local = t.chunk(world, dim=axis)[rank].clone()
            sharded[name] = ldc.ShardedTensor.from_rank_offsets(name, local, (axis, rank, world))
    ldc.save({"model": sharded, "step": 3}, ckpt)
    report = ldc.export.to_safetensors(ckpt, out, max_shard_size=max_shard)
    # A failure on one rank (its checkpoint is missing) is raised on every rank, none waits.
    with pytest.raises(ldc.CheckpointingError, match="rank 1"):
        ldc.export.to_safetensors(ckpt if rank == 0 else ckpt + "-missing", out + "-bad", max_shard_size=max_shard)
    return report


def test_safetensors_from_tp2_loads_in_transformers(tmp_path):
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    config, model = _tiny_llama()
    original = {k: v.clone() for k, v in model.state_dict().items()}
    weights_file = str(tmp_path / "weights.pt")
    torch.save(original, weights_file)
    total = sum(t.numel() * t.element_size() for t in original.values())
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "hf")
    reports = run_distributed(_save_tp_and_export, 2, weights_file, ckpt, out, total // 4)
    assert {**reports[0].__dict__, "seconds": 0} == {**reports[1].__dict__, "seconds": 0}  # the same on every rank
    assert reports[0].kind == "safetensors" and reports[0].tensors == len(original) and reports[0].bytes == total

    index = json.loads((tmp_path / "hf" / INDEX_FILE).read_text())
    assert index["metadata"]["total_size"] == total and set(index["weight_map"]) == set(original)
    files = sorted(set(index["weight_map"].values()))
    assert len(files) >= 4 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert not (tmp_path / "hf" / SINGLE_FILE).exists()
    from_files = {}
    for f in files:
        from_files.update(load_file(str(tmp_path / "hf" / f)))
    assert from_files.keys() == original.keys()
    assert all(torch.equal(from_files[k], v) for k, v in original.items())

    config.save_pretrained(out)
    loaded = LlamaForCausalLM.from_pretrained(out).state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in original.items())

    template = {k: ldc.ShardedTensor.from_rank_offsets(k, torch.zeros_like(v)) for k, v in original.items()}
    back = ldc.load(template, out)  # ldc reads HF directories
    assert all(torch.equal(back[k], v) for k, v in original.items())


def _small_checkpoint(path: str) -> dict:
    g = torch.Generator().manual_seed(1)
    tensors = {"a.weight": torch.randn(5, 7, generator=g), "b.weight": torch.randn(16, generator=g).bfloat16(),
               "c.ids": torch.arange(40, dtype=torch.int64).reshape(10, 4), "d.scale": torch.randn(3, 3, generator=g)}
    ldc.save({"t": {k: ldc.ShardedTensor.from_rank_offsets(k, v) for k, v in tensors.items()},
              "step": 7, "lr": 0.5}, path)
    return tensors


def test_single_file_and_reexport_replace_stale_files(tmp_path):
    from safetensors.torch import load_file

    tensors = _small_checkpoint(str(tmp_path / "ckpt"))
    out = tmp_path / "hf"
    report = ldc.export.to_safetensors(tmp_path / "ckpt", out)
    assert sorted(os.listdir(out)) == [SINGLE_FILE]
    assert report.tensors == 4
    got = load_file(str(out / SINGLE_FILE))
    assert all(torch.equal(got[k], v) for k, v in tensors.items())

    ldc.export.to_safetensors(tmp_path / "ckpt", out, max_shard_size=200)  # sharded: the single file goes
    names = sorted(os.listdir(out))
    assert INDEX_FILE in names and SINGLE_FILE not in names and len(names) > 2
    ldc.export.to_safetensors(tmp_path / "ckpt", out, max_shard_size="1MiB", key_map=lambda k: None if k == "c.ids" else k)
    assert sorted(os.listdir(out)) == [SINGLE_FILE]  # index and shards of the sharded export removed
    assert set(load_file(str(out / SINGLE_FILE))) == {"a.weight", "b.weight", "d.scale"}
    with pytest.raises(ArgumentError, match="is the checkpoint"):
        ldc.export.to_safetensors(out, out)  # would overwrite the files it reads


def _meta(name: str, nbytes: int) -> ExportTensor:
    return ExportTensor(name, name, (nbytes // 4,), torch.float32)


def test_plan_is_a_pure_function_of_sorted_names_and_sizes():
    tensors = [_meta("c", 400), _meta("a", 400), _meta("b", 4000), _meta("d", 40)]
    files = plan_files(tensors, 1000)
    assert [[t.name for t in f.tensors] for f in files] == [["a"], ["b"], ["c", "d"]]  # b, larger, alone
    assert [f.name for f in files] == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert plan_files(list(reversed(tensors)), 1000) == files
    assert assign_files(files, 2) == [1, 0, 1]  # largest first to the least loaded rank
    assert assign_files(files, 1) == [0, 0, 0]
    assert plan_files(tensors, 10**6) == [ShardFile(SINGLE_FILE, tuple(sorted(tensors, key=lambda t: t.name)))]


@pytest.mark.parametrize("text,n", [("5GB", 5 * 10**9), ("500MiB", 500 << 20), ("1000", 1000), (4096, 4096),
                                    ("1.5 kb", 1500)])
def test_parse_size(text, n):
    assert parse_size(text) == n


@pytest.mark.parametrize("bad", ["", "5 parsecs", "-1GB", 0, True])
def test_parse_size_refuses(bad):
    with pytest.raises(ldc.CheckpointingError, match="max_shard_size"):
        parse_size(bad)


def test_memory_bound_one_shard_or_one_tensor_at_a_time(tmp_path, monkeypatch):
    _small_checkpoint(str(tmp_path / "ckpt"))
    batches = []

    def spy(read):
        def wrapped(source, tensors, reader):
            batches.append(sum(t.nbytes for t in tensors))
            return read(source, tensors, reader)
        return wrapped

    monkeypatch.setattr(safetensors_out, "read_whole", spy(safetensors_out.read_whole))
    ldc.export.to_safetensors(tmp_path / "ckpt", tmp_path / "hf", max_shard_size=400)
    assert batches == [140 + 32, 320 + 36]  # one file's tensors at a time, each batch within the limit
    batches.clear()
    monkeypatch.setattr(dcp_out, "read_whole", spy(dcp_out.read_whole))
    ldc.export.to_dcp(tmp_path / "ckpt", tmp_path / "dcp")
    assert sorted(batches) == sorted([140, 32, 320, 36])  # each tensor read alone, when DCP writes it


def _dcp_load_sharded(rank: int, world: int, out: str, shapes: dict):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    template = {k: distribute_tensor(torch.zeros(shape, dtype=dtype), mesh, [Shard(0)])
                for k, (shape, dtype) in shapes.items()}
    template.update(step=0, lr=0.0)
    dcp.load(template, checkpoint_id=out)
    return {k: (v.to_local().clone() if hasattr(v, "to_local") else v) for k, v in template.items()}


def test_dcp_export_loads_under_dtensor_split_and_plain(tmp_path):
    import torch.distributed.checkpoint as dcp

    tensors = _small_checkpoint(str(tmp_path / "ckpt"))
    out = str(tmp_path / "dcp")
    report = ldc.export.to_dcp(tmp_path / "ckpt", out)
    assert report.kind == "dcp" and report.tensors == 4 and os.path.isfile(os.path.join(out, ".metadata"))

    shapes = {k: (tuple(v.shape), v.dtype) for k, v in tensors.items()}
    per_rank = run_distributed(_dcp_load_sharded, 2, out, shapes)
    for rank, got in enumerate(per_rank):
        assert got["step"] == 7 and got["lr"] == 0.5  # common state: DCP bytes entries
        for k, v in tensors.items():
            assert torch.equal(got[k], v.chunk(2, dim=0)[rank])  # a.weight's 5 rows split 3 + 2

    plain = {k: torch.zeros_like(v) for k, v in tensors.items()}
    plain.update(step=0, lr=0.0)
    dcp.load(plain, checkpoint_id=out, no_dist=True)
    assert all(torch.equal(plain[k], v) for k, v in tensors.items()) and plain["step"] == 7
    back = ldc.load_plain_tensors(out)  # and our own DCP reader
    assert all(torch.equal(back[k], v) for k, v in tensors.items())
    ldc.export.to_safetensors(out, tmp_path / "hf", max_shard_size=400)  # any source ldc reads: DCP -> safetensors
    assert all(torch.equal(ldc.load_plain_tensors(tmp_path / "hf")[k], v) for k, v in tensors.items())

    ldc.export.to_dcp(tmp_path / "ckpt", out, key_map={"a.weight": "renamed"})  # replaces the DCP directory
    assert "renamed" in ldc.load_tensors_metadata(out)
    (tmp_path / "user").mkdir()
    (tmp_path / "user" / "notes.txt").write_text("mine")
    with pytest.raises(ldc.CheckpointingError, match="not a DCP checkpoint"):
        ldc.export.to_dcp(tmp_path / "ckpt", tmp_path / "user")
    assert (tmp_path / "user" / "notes.txt").read_text() == "mine"


def test_lightning_trainer_checkpoint_exports_module_keys(tmp_path):
    from lightning_distckpt.lightning import DistCheckpointIO
    from safetensors.torch import load_file

    w, b, m = torch.randn(4, 3), torch.randn(4), torch.randn(4, 3)
    checkpoint = {"state_dict": {"layer.weight": w, "layer.bias": b}, "epoch": 2, "global_step": 10,
                  "optimizer_states": [{"state": {0: {"exp_avg": m}}, "param_groups": [{"lr": 0.1, "params": [0]}]}]}
    DistCheckpointIO().save_checkpoint(checkpoint, str(tmp_path / "ckpt"))

    ldc.export.to_safetensors(tmp_path / "ckpt", tmp_path / "hf")
    got = load_file(str(tmp_path / "hf" / SINGLE_FILE))
    assert set(got) == {"layer.weight", "layer.bias"}  # the LightningModule's keys; no optimizer state
    assert torch.equal(got["layer.weight"], w) and torch.equal(got["layer.bias"], b)

    import torch.distributed.checkpoint as dcp

    ldc.export.to_dcp(tmp_path / "ckpt", tmp_path / "dcp")
    state = {"state_dict": {"layer.weight": torch.zeros(4, 3), "layer.bias": torch.zeros(4)}, "epoch": 0}
    dcp.load(state, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)  # as Lightning's own DCP checkpoints
    assert torch.equal(state["state_dict"]["layer.weight"], w) and state["epoch"] == 2
    assert torch.equal(ldc.load_plain_tensors(tmp_path / "dcp")["optimizer_states/0/state/0/exp_avg"], m)


def test_cli_convert_to_safetensors_and_dcp(tmp_path, capsys):
    tensors = _small_checkpoint(str(tmp_path / "ckpt"))
    ckpt = str(tmp_path / "ckpt")
    assert cli_main(["convert", ckpt, str(tmp_path / "hf"), "--to", "safetensors", "--max-shard-size", "200B"]) == 0
    line = capsys.readouterr().out.strip()
    assert "\n" not in line and "(safetensors): 4 tensor(s)" in line
    assert (tmp_path / "hf" / INDEX_FILE).exists()
    assert cli_main(["convert", ckpt, str(tmp_path / "dcp"), "--to", "dcp"]) == 0
    assert "(dcp): 4 tensor(s)" in capsys.readouterr().out
    assert torch.equal(ldc.load_plain_tensors(tmp_path / "dcp")["c.ids"], tensors["c.ids"])

    assert cli_main(["convert", ckpt, str(tmp_path / "x"), "--to", "safetensors", "--max-shard-size", "lots"]) == 2
    assert "max_shard_size 'lots'" in capsys.readouterr().err
    assert cli_main(["convert", ckpt, str(tmp_path / "y"), "--to", "dcp", "--max-shard-size", "1GB"]) == 2
    assert cli_main(["convert", str(tmp_path / "nope"), str(tmp_path / "z"), "--to", "dcp"]) == 2
    assert "no such file" in capsys.readouterr().err


def test_sharded_trainer_layout_exports_module_keys(tmp_path):
    """The tree DistCheckpointStrategy saves: module ShardedTensors under "state_dict" keyed by the
    module's own keys, optimizer state by its own keys, the manifest listing where each sat."""
    from safetensors.torch import load_file

    from lightning_distckpt.export.tensors import LIGHTNING_MANIFEST_KEY
    from lightning_distckpt.lightning.tree import KIND_SHARDED, MANIFEST_KEY, manifest

    assert LIGHTNING_MANIFEST_KEY == MANIFEST_KEY
    w, m = torch.randn(6, 2), torch.randn(6, 2)
    tree = {"state_dict": {"enc.proj.weight": ldc.ShardedTensor.from_rank_offsets("enc.proj.weight", w)},
            "optimizer_states": [{"state": {0: {"exp_avg": ldc.ShardedTensor.from_rank_offsets(
                "optimizer_states.0.enc.proj.weight.exp_avg", m)}}}], "epoch": 1}
    tree[MANIFEST_KEY] = manifest(tree, KIND_SHARDED)
    ldc.save(tree, tmp_path / "ckpt")
    report = ldc.export.to_safetensors(tmp_path / "ckpt", tmp_path / "hf", key_map={"enc.proj.weight": "proj.weight"})
    assert report.tensors == 1
    got = load_file(str(tmp_path / "hf" / SINGLE_FILE))
    assert list(got) == ["proj.weight"] and torch.equal(got["proj.weight"], w)


def test_dcp_export_failure_is_a_checkpointing_error_and_leaves_nothing(tmp_path, monkeypatch):
    _small_checkpoint(str(tmp_path / "ckpt"))

    def broken(source, tensors, reader):
        raise ldc.FormatError(f"chunk of {tensors[0].key!r} is damaged")

    monkeypatch.setattr(dcp_out, "read_whole", broken)
    with pytest.raises(ldc.CheckpointingError, match="is damaged"):
        ldc.export.to_dcp(tmp_path / "ckpt", tmp_path / "dcp")
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # no output, no staging directory left


def test_safetensors_we_write_carry_crcs_checked_when_read_back(tmp_path, monkeypatch):
    """safetensors holds no checksum; our exports record each tensor's CRC-32C in __metadata__ (other
    readers ignore it) and every read checks it (a slice by reading its tensor whole): a flipped data
    byte is named, not returned."""
    from safetensors import safe_open

    from lightning_distckpt.storage.safetensors_crcs import CRC_KEY

    tensors = _small_checkpoint(str(tmp_path / "ckpt"))
    out = tmp_path / "hf"
    ldc.export.to_safetensors(tmp_path / "ckpt", out)
    with safe_open(str(out / SINGLE_FILE), framework="pt") as f:
        assert CRC_KEY in f.metadata() and torch.equal(f.get_tensor("a.weight"), tensors["a.weight"])
    assert all(torch.equal(v, tensors[k]) for k, v in ldc.load_plain_tensors(str(out)).items())
    data = bytearray((out / SINGLE_FILE).read_bytes())
    data[data.index(tensors["d.scale"].numpy().tobytes()) + 5] ^= 0x08
    (out / SINGLE_FILE).write_bytes(data)
    with pytest.raises(ldc.CheckpointingError, match="'d.scale' is damaged.*CRC-32C"):
        ldc.load_plain_tensors(str(out))
    template = {k: ldc.ShardedTensor.from_rank_offsets(k, torch.zeros_like(v)) for k, v in tensors.items()}
    with pytest.raises(ldc.CheckpointingError, match="'d.scale' is damaged"):
        ldc.load(template, str(out))
    # a slice of a tensor (rows 0:1 of 3, the flipped byte in row 0): the tensor is read whole and checked
    part = {"d.scale": ldc.ShardedTensor.from_rank_offsets("d.scale", torch.zeros(1, 3), (0, 0, 3))}
    with pytest.raises(ldc.CheckpointingError, match="'d.scale' is damaged"):
        ldc.load(part, str(out))
    monkeypatch.setenv("LIGHTNING_DISTCKPT_VERIFY", "0")  # salvage: slices read only their bytes
    assert ldc.load(part, str(out))["d.scale"].shape == (1, 3)
    assert not torch.equal(ldc.load_plain_tensors(str(out))["d.scale"], tensors["d.scale"])
