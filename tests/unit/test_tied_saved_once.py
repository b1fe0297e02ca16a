"""Tied weights stored once (format 8): a key whose every shard is, on every rank, the very memory of another
key's shard is written once and recorded in metadata.json's ``aliases``; every reader serves it from its target.
Untied states keep format 7 (readable by older releases); a hostile ``aliases`` field is refused."""

import hashlib
import json
import os

import pytest
import torch

from dist_utils import run_distributed

ROWS, COLS = 512, 64  # 128 KiB of fp32: above planning/aliases.TIE_MIN_BYTES


def _values(shape=(ROWS, COLS), seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g)


def _state(ldc, tied, rank=0, world=1, emb=None):
    """``embed`` and ``head`` (tied: one tensor, as module.state_dict() gives: two detached views of one
    memory), split by rows over ``world`` ranks, and a small untied ``norm``."""
    emb = _values() if emb is None else emb
    local = emb.chunk(world, 0)[rank].contiguous()
    head = local if tied else local.clone()
    return {
        "model.embed_tokens.weight": ldc.ShardedTensor.from_rank_offsets(
            "model.embed_tokens.weight", local.detach(), (0, rank, world)),
        "lm_head.weight": ldc.ShardedTensor.from_rank_offsets("lm_head.weight", head.detach(), (0, rank, world)),
        "norm": ldc.ShardedTensor.from_rank_offsets("norm", torch.arange(8.0) + rank * 0, replica_id=rank),
    }


def _template(ldc, tied, rank=0, world=1):
    return _state(ldc, tied, rank, world, emb=torch.zeros(ROWS, COLS))


def _meta(ck):
    with open(os.path.join(ck, "metadata.json")) as f:
        return json.load(f)


def _stored_bytes(ck):
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(os.path.join(ck, "data")) for f in fs)


def test_tie_written_once_and_recorded(tmp_path):
    import lightning_distckpt as ldc

    tied, untied = str(tmp_path / "tied"), str(tmp_path / "untied")
    ldc.save(_state(ldc, True), tied)
    ldc.save(_state(ldc, False), untied)
    meta = _meta(tied)
    assert meta["format_version"] == 8
    assert meta["aliases"] == {"model.embed_tokens.weight": {"target": "lm_head.weight", "global_shape": [ROWS, COLS],
                                                             "dtype": "float32"}}
    assert "model.embed_tokens.weight" not in meta["tensors"]
    assert _meta(untied)["format_version"] == 7 and "aliases" not in _meta(untied)  # older readers read it
    one = ROWS * COLS * 4
    assert _stored_bytes(untied) - _stored_bytes(tied) >= one * 0.95  # the embedding's bytes, saved once
    assert _stored_bytes(tied) < _stored_bytes(untied) * 0.6


def _check_loads(ck, rank=0, world=1):
    """Every reader serves the alias, bit-exact: tied and untied templates (strict), plain tensors, metadata."""
    import lightning_distckpt as ldc

    emb = _values().chunk(world, 0)[rank]
    out = []
    for tied in (True, False):
        tpl = _template(ldc, tied, rank, world)
        loaded = ldc.load(tpl, ck, strict="raise_all")
        a, b = loaded["model.embed_tokens.weight"], loaded["lm_head.weight"]
        out.append(torch.equal(a, emb) and torch.equal(b, emb)
                   and ((a.data_ptr() == b.data_ptr()) == tied))  # the tie kept; an untied template stays untied
    if rank == 0:
        plain = ldc.load_plain_tensors(ck)
        out.append(torch.equal(plain["model.embed_tokens.weight"], _values())
                   and torch.equal(plain["lm_head.weight"], _values()))
        md = ldc.load_tensors_metadata(ck)
        out.append(md["model.embed_tokens.weight"].global_shape == (ROWS, COLS) and "lm_head.weight" in md)
    return all(out)


def test_every_reader_serves_the_alias_in_one_process(tmp_path):
    import lightning_distckpt as ldc

    ck = str(tmp_path / "ck")
    ldc.save(_state(ldc, True), ck)
    assert _check_loads(ck)
    report = ldc.validate(ck)
    assert report.problems == [] and report.warnings == []


def _save_and_load_2(rank, world, ck):
    import lightning_distckpt as ldc

    ldc.save(_state(ldc, True, rank, world), ck)
    return _check_loads(ck, rank, world)


def _load_split_2(rank, world, ck):
    return _check_loads(ck, rank, world)


def test_two_ranks_save_once_and_reshard(tmp_path):
    import lightning_distckpt as ldc

    ck = str(tmp_path / "ck2")
    assert run_distributed(_save_and_load_2, 2, ck, timeout_s=30) == [True, True]
    assert _meta(ck)["format_version"] == 8 and list(_meta(ck)["aliases"]) == ["model.embed_tokens.weight"]
    one = str(tmp_path / "ck1")  # saved by one process, read row-split by two
    ldc.save(_state(ldc, True), one)
    assert run_distributed(_load_split_2, 2, one, timeout_s=30) == [True, True]


def _tied_on_rank0_only(rank, world, ck):
    import lightning_distckpt as ldc

    ldc.save(_state(ldc, rank == 0, rank, world), ck)
    return True


def test_tie_on_some_ranks_only_is_written_twice(tmp_path):
    ck = str(tmp_path / "ck")
    assert run_distributed(_tied_on_rank0_only, 2, ck, timeout_s=30) == [True, True]
    meta = _meta(ck)
    assert "aliases" not in meta and meta["format_version"] == 7 and "model.embed_tokens.weight" in meta["tensors"]


def test_relayout_and_export_keep_the_alias(tmp_path):
    import safetensors.torch

    import lightning_distckpt as ldc
    from lightning_distckpt.convert import relayout_checkpoint
    from lightning_distckpt.export import to_safetensors

    ck, zarr = str(tmp_path / "ck"), str(tmp_path / "zarr")
    ldc.save(_state(ldc, True), ck)
    relayout_checkpoint(ck, zarr, ldc.StorageOptions(layout="zarr"))
    assert _meta(zarr)["aliases"] == _meta(ck)["aliases"] and _meta(zarr)["format_version"] == 8
    assert _check_loads(zarr) and ldc.validate(zarr).problems == []
    out = str(tmp_path / "st")
    to_safetensors(ck, out)
    got = {}
    for name in os.listdir(out):
        if name.endswith(".safetensors"):
            got.update(safetensors.torch.load_file(os.path.join(out, name)))
    assert torch.equal(got["model.embed_tokens.weight"], _values()) and torch.equal(got["lm_head.weight"], _values())


def test_inspect_shows_the_alias(tmp_path, capsys):
    import lightning_distckpt as ldc
    from lightning_distckpt.cli.main import main

    ck = str(tmp_path / "ck")
    ldc.save(_state(ldc, True), ck)
    main(["inspect", ck])
    assert "model.embed_tokens.weight" in capsys.readouterr().out


def _rewrite(ck, edit):
    meta = _meta(ck)
    edit(meta)
    raw = json.dumps(meta).encode()
    with open(os.path.join(ck, "metadata.json"), "wb") as f:
        f.write(raw)
    with open(os.path.join(ck, "COMMITTED")) as f:
        marker = json.load(f)
    marker["metadata_sha256"] = hashlib.sha256(raw).hexdigest()  # self-consistent: the field is what is hostile
    with open(os.path.join(ck, "COMMITTED"), "w") as f:
        json.dump(marker, f)


def _alias(target, shape=(ROWS, COLS), dtype="float32"):
    return {"target": target, "global_shape": list(shape), "dtype": dtype}


HOSTILE = {
    "to nothing": lambda m: m["aliases"].update({"model.embed_tokens.weight": _alias("absent")}),
    "cycle": lambda m: m["aliases"].update({"model.embed_tokens.weight": _alias("x"), "x": _alias(
        "model.embed_tokens.weight")}),
    "chain": lambda m: m["aliases"].update({"x": _alias("model.embed_tokens.weight")}),
    "shape lie": lambda m: m["aliases"].update({"model.embed_tokens.weight": _alias("lm_head.weight", (ROWS, 1))}),
    "dtype lie": lambda m: m["aliases"].update({"model.embed_tokens.weight": _alias("lm_head.weight",
                                                                                    dtype="float16")}),
    "alias also stored": lambda m: m["aliases"].update({"norm": _alias("lm_head.weight")}),
    "not an object": lambda m: m.update({"aliases": ["model.embed_tokens.weight"]}),
    "in format 7": lambda m: m.update({"format_version": 7}),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_aliases_refused(tmp_path, name):
    import lightning_distckpt as ldc

    ck = str(tmp_path / "ck")
    ldc.save(_state(ldc, True), ck)
    _rewrite(ck, HOSTILE[name])
    with pytest.raises(ldc.FormatError, match="aliases"):
        ldc.load_tensors_metadata(ck)
    with pytest.raises(ldc.FormatError, match="aliases"):
        ldc.load(_template(ldc, True), ck)


def test_gpt2_tied_module_round_trip(tmp_path):
    """A Hugging Face tied LM through its module state dict: stored once, loaded back tied."""
    transformers = pytest.importorskip("transformers")
    import lightning_distckpt as ldc
    from lightning_distckpt.lightning.parallel import module_sharded_state_dict

    def gpt2():
        torch.manual_seed(0)
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=512, n_positions=16, n_embd=64, n_layer=1, n_head=2, tie_word_embeddings=True))

    model, ck = gpt2(), str(tmp_path / "ck")
    ldc.save(module_sharded_state_dict(model), ck)
    meta = _meta(ck)
    assert meta["aliases"]["transformer.wte.weight"]["target"] == "lm_head.weight"
    fresh = gpt2()
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    ldc.load(module_sharded_state_dict(fresh), ck, strict="raise_all")
    assert fresh.lm_head.weight is fresh.transformer.wte.weight
    assert torch.equal(fresh.lm_head.weight, model.lm_head.weight)


def _tied_on_rank0_only_same_layout(rank, world, ck):
    """Both ranks describe the same even split (so their records, but for the tie, are alike): rank 0's head is
    its embedding's memory, rank 1's a different tensor. Each rank then loads its rows of both keys."""
    import lightning_distckpt as ldc

    emb = _values()
    state = _state(ldc, rank == 0, rank, world, emb=emb)
    del state["norm"]
    if rank == 1:  # untied here, and with other values: served from the embedding, they would come back wrong
        state["lm_head.weight"].data.mul_(-1)
    ldc.save(state, ck)
    template = _template(ldc, False, rank, world)
    del template["norm"]
    ldc.load(template, ck)
    mine = emb.chunk(world, 0)[rank]
    return (torch.equal(template["model.embed_tokens.weight"].data, mine)
            and torch.equal(template["lm_head.weight"].data, mine if rank == 0 else -mine))


def test_tie_on_one_rank_of_an_even_split_is_written_twice(tmp_path):
    """Ranks whose records differ only by a tie are not one group: the coordinator sees every rank's ties."""
    ck = str(tmp_path / "ck")
    assert run_distributed(_tied_on_rank0_only_same_layout, 2, ck, timeout_s=30) == [True, True]
    assert "aliases" not in _meta(ck) and _meta(ck)["format_version"] == 7
