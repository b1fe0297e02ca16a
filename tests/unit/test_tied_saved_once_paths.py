"""Tied weights stored once (format 8), the paths tests/unit/test_tied_saved_once.py does not take: async saves
(the background snapshot copying the tied memory), a plan cache across saves where the tie comes and goes,
factory outputs, the torch and DCP exports, ``load_plain_tensors`` (an alias is its target's tensor: a
metadata.json naming thousands of aliases must not make thousands of copies), ``inspect`` (says which key is an
alias of which, and counts the stored bytes once) and hostile aliases naming objects."""

import json

import pytest
import torch

from test_tied_saved_once import _meta, _rewrite  # metadata.json read, and edited keeping COMMITTED's hash

ROWS, COLS = 512, 64  # 128 KiB of fp32: above planning/aliases.TIE_MIN_BYTES
EMB, HEAD = "a.embed", "b.head"  # the smaller key is stored, the other is the alias


def _values(seed=0):
    return torch.randn((ROWS, COLS), generator=torch.Generator().manual_seed(seed))


def _state(ldc, emb, head=None):
    """``EMB`` and ``HEAD``: one memory (tied, as module.state_dict() gives it) unless ``head`` is given."""
    head = emb if head is None else head
    return {EMB: ldc.ShardedTensor.from_rank_offsets(EMB, emb.detach()),
            HEAD: ldc.ShardedTensor.from_rank_offsets(HEAD, head.detach())}


def _both(ldc, ck):
    """Both keys loaded into an untied template."""
    out = ldc.load({EMB: ldc.ShardedTensor.from_rank_offsets(EMB, torch.zeros(ROWS, COLS)),
                    HEAD: ldc.ShardedTensor.from_rank_offsets(HEAD, torch.zeros(ROWS, COLS))}, ck)
    return out[EMB], out[HEAD]


def test_async_background_snapshot_stores_the_tie_once_with_the_snapshot_values(tmp_path):
    """The tie is found on the live tensors; the background copy is of the values at save time, not later ones."""
    import lightning_distckpt as ldc

    saver, emb, ck = ldc.AsyncSaver(), _values(), str(tmp_path / "ck")
    request = saver.save(_state(ldc, emb), ck, background_snapshot=True)
    request.wait_snapshot()
    emb.add_(100)  # after the snapshot: not what the checkpoint holds
    saver.finalize()
    assert _meta(ck)["aliases"] == {HEAD: {"target": EMB, "global_shape": [ROWS, COLS], "dtype": "float32"}}
    a, b = _both(ldc, ck)
    assert torch.equal(a, _values()) and torch.equal(b, _values())


def test_plan_cache_replans_when_the_tie_comes_and_goes(tmp_path):
    """One AsyncSaver (one SavePlanCache) saving tied, untied (other values), tied, tied: each checkpoint as its
    state was; only the last reuses a plan."""
    import lightning_distckpt as ldc

    saver, emb, other = ldc.AsyncSaver(), _values(1), _values(2)
    for i, tied in enumerate((True, False, True, True)):
        ck = str(tmp_path / f"ck{i}")
        saver.save(_state(ldc, emb, None if tied else other), ck)
        saver.finalize()
        assert ("aliases" in _meta(ck)) == tied and _meta(ck)["format_version"] == (8 if tied else 7)
        a, b = _both(ldc, ck)
        assert torch.equal(a, emb) and torch.equal(b, emb if tied else other), i
    assert (saver.plan_cache.hits, saver.plan_cache.misses) == (1, 3)


def _build(key, data, replica_id, flattened_range=None):
    import lightning_distckpt as ldc

    return {"w": ldc.ShardedTensor.from_rank_offsets(key + ".w", data),
            "v": ldc.ShardedTensor.from_rank_offsets(key + ".v", data)}


def _merge(built):
    return built["w"]


def test_factory_outputs_of_one_memory_are_stored_once(tmp_path):
    import lightning_distckpt as ldc

    emb, ck = _values(), str(tmp_path / "ck")
    ldc.save({"f": ldc.ShardedTensorFactory("f", emb, _build, _merge)}, ck)
    assert _meta(ck)["aliases"] == {"f.w": {"target": "f.v", "global_shape": [ROWS, COLS], "dtype": "float32"}}
    out = ldc.load({"f": ldc.ShardedTensorFactory("f", torch.zeros(ROWS, COLS), _build, _merge)}, ck)
    assert torch.equal(out["f"], emb)


def test_torch_and_dcp_exports_hold_the_alias_under_both_names(tmp_path):
    import torch.distributed.checkpoint as dcp

    import lightning_distckpt as ldc
    from lightning_distckpt.export import to_dcp, to_torch_file

    ck = str(tmp_path / "ck")
    ldc.save(_state(ldc, _values()), ck)
    to_torch_file(ck, str(tmp_path / "t.pt"))
    tensors = torch.load(str(tmp_path / "t.pt"), weights_only=True)["tensors"]
    assert sorted(tensors) == [EMB, HEAD] and all(torch.equal(t, _values()) for t in tensors.values())
    to_dcp(ck, str(tmp_path / "dcp"))
    back = {EMB: torch.zeros(ROWS, COLS), HEAD: torch.zeros(ROWS, COLS)}
    dcp.load(back, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    assert all(torch.equal(t, _values()) for t in back.values())


def test_load_plain_tensors_serves_an_alias_as_its_target(tmp_path):
    """A hostile metadata.json naming 64 aliases of one stored tensor: one tensor in memory, not 65 (before: one
    copy per alias, so a few bytes of JSON per alias held the target's bytes once more each); 65 are refused."""
    import lightning_distckpt as ldc

    ck = str(tmp_path / "ck")
    ldc.save(_state(ldc, _values()), ck)
    _rewrite(ck, lambda m: m["aliases"].update({f"z{i}": dict(m["aliases"][HEAD]) for i in range(63)}))
    plain = ldc.load_plain_tensors(ck)  # 64 aliases of one tensor: the most a checkpoint may name
    assert len(plain) == 65 and torch.equal(plain[EMB], _values())
    assert {t.data_ptr() for t in plain.values()} == {plain[EMB].data_ptr()}
    assert ldc.validate(ck).problems == []
    _rewrite(ck, lambda m: m["aliases"].update({"z63": dict(m["aliases"][HEAD])}))  # one more: every export
    with pytest.raises(ldc.FormatError, match="names .* 65 times \\(at most 64"):  # would write it 65 times
        ldc.load_plain_tensors(ck)


def test_inspect_names_the_alias_and_counts_its_bytes_once(tmp_path, capsys):
    import lightning_distckpt as ldc
    from lightning_distckpt.cli.main import main

    ck = str(tmp_path / "ck")
    ldc.save(_state(ldc, _values()), ck)
    capsys.readouterr()
    assert main(["inspect", ck]) == 0
    row = [line for line in capsys.readouterr().out.splitlines() if line.startswith(HEAD)]
    assert len(row) == 1 and f"alias of {EMB}" in row[0], row
    assert main(["inspect", "--json", ck]) == 0
    summary = json.loads(capsys.readouterr().out)
    by_key = {t["key"]: t for t in summary["tensors"]}
    assert by_key[HEAD]["alias_of"] == EMB and by_key[EMB]["alias_of"] is None
    assert summary["tensor_bytes"] == ROWS * COLS * 4  # stored once
    assert summary["packed_shards"] == 1  # the one stored shard (packed: under pack_max_bytes)


def _with_object(ldc, emb):
    state = _state(ldc, emb)
    state["obj"] = ldc.ShardedObject("obj", {"x": 1}, (1,), (0,))
    return state


HOSTILE = {
    "alias naming an object": lambda m: m["aliases"].update({HEAD: {**m["aliases"][HEAD], "target": "obj"}}),
    "an object key as an alias": lambda m: m["aliases"].update({"obj": dict(m["aliases"][HEAD])}),
    "alias of an unevenly stored key": lambda m: m["aliases"].update({"z": {**m["aliases"][HEAD], "target": "u"}}),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_aliases_involving_objects_and_shapes(tmp_path, name):
    import lightning_distckpt as ldc

    ck = str(tmp_path / "ck")
    state = _with_object(ldc, _values())
    state["u"] = ldc.ShardedTensor.from_rank_offsets("u", torch.arange(10.0))  # (10,), not (ROWS, COLS)
    ldc.save(state, ck)
    _rewrite(ck, HOSTILE[name])
    with pytest.raises(ldc.FormatError, match="aliases"):
        ldc.load_tensors_metadata(ck)
    with pytest.raises(ldc.FormatError, match="aliases"):
        ldc.load_plain_tensors(ck)
