"""``ldc.load`` reads ordinary files straight into any split: torch.save files (plain state dicts and
Lightning checkpoints), .safetensors files and Hugging Face model directories written by
``transformers`` (built locally, nothing downloaded), on real gloo groups of 1, 2 and 4."""

import json
import os

import pytest
import torch

import lightning_distckpt as ldc
from dist_utils import run_distributed
from lightning_distckpt.core.errors import FormatError, MissingKeysError


def full_state():
    g = torch.Generator().manual_seed(0)
    return {
        "emb.weight": torch.randn(16, 12, generator=g),
        "fc.weight": torch.randn(12, 10, generator=g).to(torch.bfloat16),
        "fc.bias": torch.arange(12, dtype=torch.float32),
        "steps": torch.arange(5, dtype=torch.int64),
    }


def template(rank, world, tp, dtype_of=lambda k, t: t.dtype):
    """Rows of emb and fc split over tp ranks (cols of emb on the other axis), replicas over dp."""
    full = full_state()
    tp_rank, dp_rank = rank % tp, rank // tp
    emb = full["emb.weight"]
    fc = full["fc.weight"]
    return {
        "emb": ldc.ShardedTensor.from_rank_offsets("emb.weight", torch.zeros(16, 12 // tp, dtype=emb.dtype),
                                                   (1, tp_rank, tp), replica_id=dp_rank),
        "fc": ldc.ShardedTensor.from_rank_offsets("fc.weight", torch.zeros(12 // tp, 10, dtype=fc.dtype),
                                                  (0, tp_rank, tp), replica_id=dp_rank),
        "bias": ldc.ShardedTensor.from_rank_offsets("fc.bias", torch.zeros(12), replica_id=rank),
        "steps": ldc.ShardedTensor.from_rank_offsets("steps", torch.zeros(5, dtype=torch.int64), replica_id=rank),
    }


def expected(rank, tp):
    full = full_state()
    tp_rank = rank % tp
    return {"emb": full["emb.weight"].chunk(tp, 1)[tp_rank], "fc": full["fc.weight"].chunk(tp, 0)[tp_rank],
            "bias": full["fc.bias"], "steps": full["steps"]}


def _load_and_compare(rank, world, path, tp, key_map, loader):
    out = ldc.load(template(rank, world, tp), path, key_map=key_map, loader=loader)
    want = expected(rank, tp)
    return {k: torch.equal(out[k], want[k]) for k in want}, out.get("epoch")


def strip_state_dict(key):
    return key.removeprefix("state_dict/")


def strip_model(key):
    return key.removeprefix("model.")


def _write(kind, tmp_path):
    from safetensors.torch import save_file

    full = full_state()
    if kind == "torch":
        path = str(tmp_path / "plain.pt")
        torch.save(full, path)
        return path, None
    if kind == "lightning":
        path = str(tmp_path / "stock.ckpt")
        torch.save({"state_dict": full, "epoch": 7, "optimizer_states": []}, path)
        return path, strip_state_dict
    path = str(tmp_path / "w.safetensors")
    save_file({("model." + k): v for k, v in full.items()}, path)
    return path, {("model." + k): k for k in full}


@pytest.mark.parametrize("kind", ["torch", "lightning", "safetensors"])
@pytest.mark.parametrize("world,tp,loader", [(1, 1, None), (2, 2, "every_rank"), (4, 2, None)])
def test_files_load_into_any_split(tmp_path, kind, world, tp, loader):
    path, key_map = _write(kind, tmp_path)
    for same, epoch in run_distributed(_load_and_compare, world, path, tp, key_map, loader):
        assert all(same.values()), same
        assert epoch == (7 if kind == "lightning" else None)


def test_missing_key_and_metadata(tmp_path):
    path, _ = _write("safetensors", tmp_path)
    meta = ldc.load_tensors_metadata(path)
    assert sorted(meta) == sorted("model." + k for k in full_state())
    assert meta["model.fc.weight"].global_shape == (12, 10) and meta["model.fc.weight"].dtype == torch.bfloat16
    with pytest.raises(MissingKeysError, match="emb.weight"):
        ldc.load(template(0, 1, 1), path)  # no key_map: the file's keys carry "model."
    # a callable returning None leaves keys out; strict RETURN_ALL reports them
    state, missing, unexpected = ldc.load(
        {"b": ldc.ShardedTensor.from_rank_offsets("fc.bias", torch.zeros(12))}, path,
        key_map=lambda k: k.removeprefix("model.") if k != "model.steps" else None, strict="return_all")
    assert torch.equal(state["b"], full_state()["fc.bias"])
    assert missing == {"emb.weight", "fc.weight"} and unexpected == set()  # Megatron-Core's meaning


def test_dtype_rule_applies(tmp_path):
    path, _ = _write("torch", tmp_path)
    t = {"s": ldc.ShardedTensor.from_rank_offsets("steps", torch.zeros(5))}  # int64 stored, float asked
    with pytest.raises(ldc.CheckpointingError, match="across|floating|integer"):
        ldc.load(t, path)


def _tiny_llama(tmp_path, safe):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    out = str(tmp_path / ("hf_safe" if safe else "hf_bin"))
    state = model.state_dict()
    if safe:
        model.save_pretrained(out, max_shard_size="20KB")
        return state, out
    # recent transformers write safetensors only: lay out the older pytorch_model.bin index by hand
    os.makedirs(out)
    names = sorted(state)
    parts = {f"pytorch_model-0000{i + 1}-of-00002.bin": names[i::2] for i in range(2)}
    for file, keys in parts.items():
        torch.save({k: state[k].clone() for k in keys}, os.path.join(out, file))
    with open(os.path.join(out, "pytorch_model.bin.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": {k: file for file, keys in parts.items() for k in keys}}, f)
    return state, out


def _load_llama_split(rank, world, path, shapes):
    tmpl = {}
    for key, shape in shapes.items():
        if len(shape) == 2 and shape[0] % world == 0:  # TP rows, as a column-parallel layer
            tmpl[key] = ldc.ShardedTensor.from_rank_offsets(key, torch.zeros(shape[0] // world, shape[1]),
                                                            (0, rank, world))
        else:
            tmpl[key] = ldc.ShardedTensor.from_rank_offsets(key, torch.zeros(shape), replica_id=rank)
    out = ldc.load(tmpl, path, key_map=strip_model)
    return {k: v.clone() for k, v in out.items()}


@pytest.mark.parametrize("safe", [True, False])
def test_hugging_face_directory_under_tp2(tmp_path, safe):
    state, path = _tiny_llama(tmp_path, safe)
    index = "model.safetensors.index.json" if safe else "pytorch_model.bin.index.json"
    with open(os.path.join(path, index)) as f:
        assert len(set(json.load(f)["weight_map"].values())) > 1  # really sharded over several files
    shapes = {k.removeprefix("model."): tuple(v.shape) for k, v in state.items() if k != "lm_head.weight"}
    results = run_distributed(_load_llama_split, 2, path, shapes)
    for rank, out in enumerate(results):
        for key, got in out.items():
            full = state["model." + key]
            want = full.chunk(2, 0)[rank] if got.shape != full.shape else full
            assert torch.equal(got, want), key


def test_bad_files_are_format_errors(tmp_path):
    good, _ = _write("safetensors", tmp_path)
    data = open(good, "rb").read()
    truncated = tmp_path / "trunc.safetensors"
    truncated.write_bytes(data[: len(data) - 40])
    with pytest.raises(FormatError, match="trunc.safetensors"):
        ldc.load_tensors_metadata(str(truncated))
    header_len = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + header_len])
    name = next(k for k in header if k != "__metadata__")
    header[name]["data_offsets"] = [0, 10 ** 9]  # points past the end
    raw = json.dumps(header).encode()
    bad = tmp_path / "past_end.safetensors"
    bad.write_bytes(len(raw).to_bytes(8, "little") + raw + data[8 + header_len:])
    with pytest.raises(FormatError, match="past_end.safetensors"):
        ldc.load_tensors_metadata(str(bad))
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "../outside.safetensors"}}))
    with pytest.raises(FormatError, match="not a file name in"):
        ldc.load_tensors_metadata(str(hf))


@pytest.mark.parametrize("safe", [True, False])
def test_an_index_that_lost_a_shard_files_entries_is_refused(tmp_path, safe):
    """The index of a sharded Hugging Face directory gives one of its numbered files no tensor (its
    entries cut out): a read without a template would silently miss that file's tensors."""
    state, path = _tiny_llama(tmp_path, safe)
    index = os.path.join(path, "model.safetensors.index.json" if safe else "pytorch_model.bin.index.json")
    with open(index) as f:
        meta = json.load(f)
    dropped = sorted(set(meta["weight_map"].values()))[-1]
    meta["weight_map"] = {k: v for k, v in meta["weight_map"].items() if v != dropped}
    with open(index, "w") as f:
        json.dump(meta, f)
    for read in (ldc.load_plain_tensors, ldc.load_tensors_metadata):
        with pytest.raises(FormatError, match=f"{dropped}.*gives it no tensor"):
            read(path)
    os.remove(os.path.join(path, dropped))  # the file gone as well: the index is all there is
    assert set(ldc.load_plain_tensors(path)) == set(meta["weight_map"])


class Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned > /dev/null",))


def test_torch_file_that_would_run_code_is_refused(tmp_path):
    path = str(tmp_path / "evil.pt")
    torch.save({"w": torch.zeros(2), "x": Evil()}, path)
    with pytest.raises(ldc.CheckpointingError, match="refused to deserialize"):
        ldc.load({"w": ldc.ShardedTensor.from_rank_offsets("w", torch.zeros(2))}, path)


def _open_fails_on_rank_1(rank, world, good, bad):
    try:
        ldc.load(template(rank, world, 2), good if rank == 0 else bad)
    except ldc.CheckpointingError as e:
        return type(e).__name__, sorted(e.failures), str(e)
    return "no error", [], ""


def test_a_rank_that_cannot_open_the_checkpoint_fails_every_rank(tmp_path):
    """Opening happens inside the load's first collective: rank 1's missing file is raised on both
    ranks instead of leaving rank 0 waiting in a collective."""
    good, _ = _write("torch", tmp_path)
    results = run_distributed(_open_fails_on_rank_1, 2, good, str(tmp_path / "absent"))
    for kind, failing, text in results:
        assert failing == [1], (kind, text)
        assert "absent" in text
