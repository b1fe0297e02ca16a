"""Save/load semantics: dtypes, objects, common state, strictness, safety and atomicity."""

import hashlib
import json
import os
import pickle

import pytest
import torch
from omegaconf import OmegaConf

import lightning_distckpt as ldc
from lightning_distckpt.core.format_versions import FORMAT_VERSION
from lightning_distckpt.storage.tensorstore_io import TensorStoreIO
from lightning_distckpt import StrictHandling
from lightning_distckpt.saving.save import SavePlanCache
from lightning_distckpt.storage.layout import COMMIT_MARKER, METADATA_FILE
from dist_utils import run_distributed

ALL_DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int8, torch.int16, torch.int32,
              torch.int64, torch.uint8, torch.bool]


def test_dtypes_round_trip_bit_exact(tmp_path):
    g = torch.Generator().manual_seed(0)
    sd = {}
    for dt in ALL_DTYPES:
        raw = torch.randint(0, 255, (5, 7), generator=g, dtype=torch.uint8)
        if dt.is_floating_point:
            t = torch.randn(5, 7, generator=g, dtype=torch.float64).to(dt)
            t[0, 0] = float("nan")
            t[0, 1] = float("-inf")
        elif dt == torch.bool:
            t = raw > 100
        else:
            t = raw.to(dt) - (0 if dt == torch.uint8 else 100)
        sd[str(dt)] = ldc.ShardedTensor.from_rank_offsets(str(dt), t)
    ldc.save(sd, tmp_path / "ck")
    plain = ldc.load_plain_tensors(tmp_path / "ck")
    for dt in ALL_DTYPES:
        want = sd[str(dt)].data
        got = plain[str(dt)]
        assert got.dtype == dt
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), dt  # bit-exact, NaN payload included
    meta = ldc.load_tensors_metadata(tmp_path / "ck")
    assert meta["torch.bfloat16"].dtype == torch.bfloat16 and meta["torch.bfloat16"].global_shape == (5, 7)
    stored = json.loads((tmp_path / "ck" / METADATA_FILE).read_text())
    assert stored["tensors"]["torch.bfloat16"]["dtype"] == "bfloat16"  # stored natively, not as float32


def test_load_converts_within_a_dtype_kind_and_refuses_across_kinds(tmp_path):
    master = torch.randn(4, 6, dtype=torch.float32)
    counts = torch.arange(-5, 5, dtype=torch.int32)
    ldc.save({"w": ldc.ShardedTensor.from_rank_offsets("w", master),
              "n": ldc.ShardedTensor.from_rank_offsets("n", counts)}, tmp_path / "ck")
    # fp32 master weights into a bf16 model, int32 into int64: converted as Tensor.copy_ would
    out = ldc.load({"w": ldc.ShardedTensor.from_rank_offsets("w", torch.empty(4, 6, dtype=torch.bfloat16)),
                    "n": ldc.ShardedTensor.from_rank_offsets("n", torch.empty(10, dtype=torch.int64))}, tmp_path / "ck")
    assert out["w"].dtype == torch.bfloat16 and torch.equal(out["w"], master.to(torch.bfloat16))
    assert out["n"].dtype == torch.int64 and torch.equal(out["n"], counts.to(torch.int64))
    # floating -> integer or bool would silently truncate: refused, naming the key and both dtypes
    for key, wrong in (("w", torch.empty(4, 6, dtype=torch.int64)), ("n", torch.empty(10, dtype=torch.bool)),
                       ("n", torch.empty(10, dtype=torch.float32))):
        with pytest.raises(ldc.CheckpointingError) as err:
            ldc.load({key: ldc.ShardedTensor.from_rank_offsets(key, wrong)}, tmp_path / "ck")
        stored = "float32" if key == "w" else "int32"
        assert repr(key) in str(err.value) and f"stored as {stored}" in str(err.value)
        assert str(wrong.dtype).replace("torch.", "") in str(err.value)


def test_objects_nonpersistent_and_common(tmp_path):
    cfg = OmegaConf.create({"lr": 0.1, "layers": [1, 2], "name": "gpt"})
    sd = {
        "model": {"w": ldc.ShardedTensor.from_rank_offsets("w", torch.ones(3))},
        "rng": ldc.ShardedObject("rng", {"seed": 7, "state": torch.arange(3)}, (1,), (0,)),
        "local": ldc.LocalNonpersistentObject("not saved"),
        "hparams": cfg,
        "step": 12,
        "schedulers": [{"last_epoch": 3}],
    }
    ldc.save(sd, tmp_path / "ck")
    common = ldc.load_common_state_dict(tmp_path / "ck")
    assert common["step"] == 12 and "local" not in common and "model" not in common
    template = {
        "model": {"w": ldc.ShardedTensor.from_rank_offsets("w", torch.zeros(3))},
        "rng": ldc.ShardedObject("rng", None, (1,), (0,)),
        "local": ldc.LocalNonpersistentObject("mine"),
        "step": -1,
    }
    out = ldc.load(template, tmp_path / "ck")
    assert torch.equal(out["model"]["w"], torch.ones(3))
    assert out["rng"]["seed"] == 7 and torch.equal(out["rng"]["state"], torch.arange(3))
    assert out["local"] == "mine"
    assert out["step"] == 12  # common state comes from the checkpoint
    assert OmegaConf.is_config(out["hparams"]) and out["hparams"].lr == 0.1
    assert out["schedulers"] == [{"last_epoch": 3}]


def _template(keys):
    return {k: ldc.ShardedTensor.from_rank_offsets(k, torch.zeros(2)) for k in keys}


def test_strict_handling_modes(tmp_path):
    """Megatron-Core's meaning: "unexpected" = asked for, not in the checkpoint; "missing" = in the
    checkpoint, asked for by no rank (tests/conformance/ compares every mode with megatron-core)."""
    ldc.save(_template(["a", "b"]), tmp_path / "ck")
    ck = tmp_path / "ck"
    # Asking for a key the checkpoint lacks raises by default and names it.
    with pytest.raises(ldc.MissingKeysError, match="Unexpected keys.*'c'"):
        ldc.load(_template(["a", "c"]), ck)
    # Leaving a saved key out is fine but under RAISE_ALL (the *_UNEXPECTED modes do not look).
    ldc.load(_template(["a"]), ck)
    ldc.load(_template(["a"]), ck, strict=StrictHandling.RAISE_UNEXPECTED)
    with pytest.raises(ldc.MissingKeysError, match="Missing keys \\(for all ranks\\): \\['b'\\]"):
        ldc.load(_template(["a"]), ck, strict="raise_all")
    with pytest.raises(ldc.MissingKeysError, match="Unexpected keys \\(of all ranks\\): \\['c'\\]"):
        ldc.load(_template(["a", "b", "c"]), ck, strict="raise_all")
    # RETURN_ALL skips unexpected keys (template kept) and reports both sets.
    tmpl = _template(["a", "c"])
    tmpl["c"].data.fill_(5)
    out, missing, unexpected = ldc.load(tmpl, ck, strict=StrictHandling.RETURN_ALL)
    assert missing == {"b"} and unexpected == {"c"}
    assert torch.equal(out["c"], torch.full((2,), 5.0))
    assert ldc.load(_template(["c"]), ck, strict=StrictHandling.RETURN_UNEXPECTED)[1:] == (set(), {"c"})
    for mode in (StrictHandling.IGNORE_ALL, StrictHandling.LOG_ALL, StrictHandling.LOG_UNEXPECTED):
        out = ldc.load(_template(["a", "c"]), ck, strict=mode)
        assert set(out) == {"a", "c"}


def test_incomplete_and_foreign_directories(tmp_path):
    with pytest.raises(ldc.IncompleteCheckpointError, match="no such directory"):
        ldc.load(_template(["a"]), tmp_path / "nope")
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "notes.txt").write_text("mine")
    with pytest.raises(ldc.IncompleteCheckpointError, match="not a lightning_distckpt checkpoint"):
        ldc.load(_template(["a"]), tmp_path / "foreign")
    # Saving over a directory that is not a checkpoint refuses and keeps its content.
    with pytest.raises(ldc.CheckpointingError, match="refusing to replace"):
        ldc.save(_template(["a"]), tmp_path / "foreign")
    assert (tmp_path / "foreign" / "notes.txt").read_text() == "mine"
    # A checkpoint without its commit marker is incomplete.
    ldc.save(_template(["a"]), tmp_path / "ck")
    os.remove(tmp_path / "ck" / COMMIT_MARKER)
    with pytest.raises(ldc.IncompleteCheckpointError, match="incomplete checkpoint"):
        ldc.load(_template(["a"]), tmp_path / "ck")


def test_unknown_format_version_is_refused(tmp_path):
    ldc.save(_template(["a"]), tmp_path / "ck")
    meta_path = tmp_path / "ck" / METADATA_FILE
    meta = json.loads(meta_path.read_text())
    meta["format_version"] = 99
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(ldc.FormatError, match="format version 99"):
        ldc.load(_template(["a"]), tmp_path / "ck")


class Evil:
    def __reduce__(self):
        return (os.system, ("touch PWNED",))


def test_format_1_checkpoints_without_packing_still_load(tmp_path, monkeypatch):
    """Format 2 packs small shards; a format 1 checkpoint (every shard its own array) still loads."""
    w, b = torch.randn(6, 5), torch.randn(5)
    sd = lambda w_, b_: {"w": ldc.ShardedTensor.from_rank_offsets("w", w_),  # noqa: E731
                         "b": ldc.ShardedTensor.from_rank_offsets("b", b_)}
    with monkeypatch.context() as mp:  # arrays as a writer before format 7 made them: no save token
        mp.setattr(TensorStoreIO, "token", property(lambda self: None))
        ldc.save(sd(w, b), tmp_path / "v1", storage=ldc.StorageOptions(pack_max_bytes=0))
    meta_path = tmp_path / "v1" / METADATA_FILE
    meta = json.loads(meta_path.read_text())
    assert all("packed" not in sh for e in meta["tensors"].values() for sh in e["shards"])
    meta["format_version"] = 1
    meta_path.write_text(json.dumps(meta))
    marker = json.loads((tmp_path / "v1" / COMMIT_MARKER).read_text())  # a format 1 marker records no checksums
    (tmp_path / "v1" / COMMIT_MARKER).write_text(json.dumps({k: marker[k] for k in ("bytes", "world_size")}))
    out = ldc.load(sd(torch.empty(6, 5), torch.empty(5)), tmp_path / "v1")
    assert torch.equal(out["w"], w) and torch.equal(out["b"], b)
    # the default packs both (they are small) into one float32 array, and loads them back
    ldc.save(sd(w, b), tmp_path / "v2")
    meta = json.loads((tmp_path / "v2" / METADATA_FILE).read_text())
    assert meta["format_version"] == FORMAT_VERSION
    assert sorted(sh["packed"] for e in meta["tensors"].values() for sh in e["shards"]) == [0, 5]
    out = ldc.load(sd(torch.empty(6, 5), torch.empty(5)), tmp_path / "v2")
    assert torch.equal(out["w"], w) and torch.equal(out["b"], b)


def _bytes_read_by_this_process():
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar"))


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="needs Linux /proc/self/io to count bytes read")
def test_loading_many_packed_shards_reads_about_the_pack_not_a_pack_per_shard(tmp_path):
    norms = {f"layer{i}.norm": torch.full((256,), float(i)) for i in range(300)}  # 1 KiB each: packed
    ldc.save({k: ldc.ShardedTensor.from_rank_offsets(k, v) for k, v in norms.items()}, tmp_path / "ck")
    meta = json.loads((tmp_path / "ck" / METADATA_FILE).read_text())
    assert all(sh["packed"] is not None for e in meta["tensors"].values() for sh in e["shards"])
    template = {k: ldc.ShardedTensor.from_rank_offsets(k, torch.empty(256)) for k in norms}
    before = _bytes_read_by_this_process()
    out = ldc.load(template, tmp_path / "ck", loader="every_rank")
    read = _bytes_read_by_this_process() - before
    assert all(torch.equal(out[k], v) for k, v in norms.items())
    # 300 KiB of data in one pack: about that much is read (plus metadata), not a pack chunk per shard
    assert read < 2 * 1024 * 1024, read


def test_malicious_pickle_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ldc.save(_template(["a"]), tmp_path / "ck")
    with open(tmp_path / "ck" / "common.pt", "wb") as f:
        pickle.dump({"x": Evil()}, f)
    marker = json.loads((tmp_path / "ck" / COMMIT_MARKER).read_text())  # a hostile checkpoint is self-consistent
    marker["common_sha256"] = hashlib.sha256((tmp_path / "ck" / "common.pt").read_bytes()).hexdigest()
    (tmp_path / "ck" / COMMIT_MARKER).write_text(json.dumps(marker))
    with pytest.raises(ldc.CheckpointingError, match="refused to deserialize"):
        ldc.load(_template(["a"]), tmp_path / "ck")
    with pytest.raises(ldc.CheckpointingError, match="refused to deserialize"):
        ldc.load_common_state_dict(tmp_path / "ck")
    assert not (tmp_path / "PWNED").exists()


def test_keys_cannot_escape_the_checkpoint(tmp_path):
    keys = ["../../escape", "/abs/path", "a/b\\c:d*?", "..", "x" * 400, "ünï cødé"]
    good = [k for k in keys if k != ".."]
    sd = {k: ldc.ShardedTensor.from_rank_offsets(k, torch.full((2,), float(i))) for i, k in enumerate(good)}
    ldc.save(sd, tmp_path / "ck")
    for root, _, files in os.walk(tmp_path):
        assert str(root).startswith(str(tmp_path / "ck")) or root == str(tmp_path)
        for f in files:
            assert len(f) < 256
    plain = ldc.load_plain_tensors(tmp_path / "ck")
    assert sorted(plain) == sorted(good)
    with pytest.raises(ldc.CheckpointingError, match="key '..' is not allowed"):
        ldc.save({"k": ldc.ShardedTensor.from_rank_offsets("..", torch.zeros(1))}, tmp_path / "ck2")


def test_overwrite_keeps_old_until_new_commits(tmp_path):
    ck = tmp_path / "ck"
    ldc.save({"a": ldc.ShardedTensor.from_rank_offsets("a", torch.ones(2))}, ck)
    # A save that fails validation writes nothing and leaves the old checkpoint loadable.
    bad = {"a": ldc.ShardedTensor.from_offsets("a", torch.zeros(2), (4,), (0,))}  # gap: half the tensor missing
    with pytest.raises(ldc.ValidationError, match="cover 2 of 4"):
        ldc.save(bad, ck)
    assert torch.equal(ldc.load(_template(["a"]), ck)["a"], torch.ones(2))
    # A successful save replaces it; no staging directories are left behind.
    ldc.save({"a": ldc.ShardedTensor.from_rank_offsets("a", torch.full((2,), 3.0))}, ck)
    assert torch.equal(ldc.load(_template(["a"]), ck)["a"], torch.full((2,), 3.0))
    assert [p.name for p in tmp_path.iterdir()] == ["ck"]


def _inconsistent_save(rank, world, path):
    # Rank 1 claims a different global shape: every rank must get the same error, nobody hangs.
    shape = (4, 2) if rank == 0 else (4, 3)
    t = torch.zeros(2, shape[1])
    sd = {"w": ldc.ShardedTensor.from_offsets("w", t, shape, (2 * rank, 0))}
    try:
        ldc.save(sd, path)
    except ldc.ValidationError as e:
        return str(e)
    return None


def test_validation_fails_on_every_rank(tmp_path):
    msgs = run_distributed(_inconsistent_save, 2, str(tmp_path / "ck"))
    assert msgs[0] is not None and msgs[0] == msgs[1]
    assert "disagree on global shape" in msgs[0] and "ranks [0]" in msgs[0] and "ranks [1]" in msgs[0]


def _differing_storage_options(rank, world, path):
    # Ranks plan independently: rank 1 packing differently from rank 0 would write shards where
    # rank 0's index does not look. Every rank must refuse before writing.
    sd = {"w": ldc.ShardedTensor.from_rank_offsets("w", torch.ones(2, 3), (0, rank, world))}
    try:
        ldc.save(sd, path, storage=ldc.StorageOptions(pack_max_bytes=0 if rank else 1024))
    except ldc.CheckpointingError as e:
        return str(e), os.path.exists(path), type(e).__name__, sorted(e.failures)
    return None, os.path.exists(path), None, None


def test_differing_planning_options_fail_on_every_rank(tmp_path):
    res = run_distributed(_differing_storage_options, 2, str(tmp_path / "ck"))
    for msg, written, kind, failing in res:
        assert msg is not None and "rank 1: planning options" in msg and "pack_max_bytes" in msg, msg
        assert kind == "ArgumentError" and failing == [1]  # only the rank whose options differ is blamed
        assert not written
    assert not (tmp_path / "ck").exists()


def _failing_rank_save(rank, world, path):
    sd = {"w": ldc.ShardedTensor.from_rank_offsets("w", torch.full((4,), float(rank)), (0, rank, world))}
    ldc.save(sd, path)  # the good checkpoint
    # Second save: rank 1's data cannot be written (a meta tensor has no bytes), ranks 0 writes fine.
    data = torch.full((4,), 9.0) if rank == 0 else torch.empty(4, device="meta")
    sd2 = {"w": ldc.ShardedTensor.from_rank_offsets("w", data, (0, rank, world))}
    try:
        ldc.save(sd2, path)
    except ldc.SaveFailedError as e:
        err = str(e)
        assert sorted(e.failures) == [1], e.failures
    else:
        err = None
    out = ldc.load({"w": ldc.ShardedTensor.from_rank_offsets("w", torch.zeros(4), (0, rank, world))}, path)
    return err, out["w"].tolist()


def test_write_failure_on_one_rank_fails_all_and_keeps_old(tmp_path):
    results = run_distributed(_failing_rank_save, 2, str(tmp_path / "ck"))
    for rank, (err, values) in enumerate(results):
        assert err is not None and "rank 1" in err and "nothing was committed" in err
        assert values == [float(rank)] * 4  # the previous checkpoint is intact
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]  # staging removed


def test_sync_save_plan_cache(tmp_path):
    cache = SavePlanCache()
    for value in (1.0, 2.0):
        ldc.save({"a": ldc.ShardedTensor.from_rank_offsets("a", torch.full((3,), value))}, tmp_path / "ck",
                 plan_cache=cache)
        assert torch.equal(ldc.load(_template(["a"]) | {"a": ldc.ShardedTensor.from_rank_offsets(
            "a", torch.zeros(3))}, tmp_path / "ck")["a"], torch.full((3,), value))
    assert (cache.hits, cache.misses) == (1, 1)


def _diverging_common_save(rank, world, path):
    import logging

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("lightning_distckpt").addHandler(handler)
    # Rank 1's step counter differs and it holds an extra key: only rank 0's copy can be saved.
    common = {"step": 5 if rank == 0 else 7, "lr": 0.1, **({"stage_only": 1} if rank == 1 else {})}
    sd = {"w": ldc.ShardedTensor.from_rank_offsets("w", torch.full((2,), float(rank)), (0, rank, world)), **common}
    ldc.save(sd, path)
    loaded = ldc.load({"w": ldc.ShardedTensor.from_rank_offsets("w", torch.zeros(2), (0, rank, world))}, path)
    warnings = [r.getMessage() for r in records if r.levelname == "WARNING"]
    return warnings, loaded["step"], loaded["w"].tolist(), "stage_only" in loaded


def test_common_state_differing_between_ranks_is_reported(tmp_path):
    results = run_distributed(_diverging_common_save, 2, str(tmp_path / "ck"))
    (warn0, step0, w0, extra0), (warn1, step1, w1, extra1) = results
    assert len(warn0) == 1 and len(warn1) == 1  # the summary by rank 0; each differing rank its own line
    assert warn1[0] == ("Rank 1 common state dict differs from rank 0 common state dict. Keys only on rank 0: [], "
                        "Keys only on 1: [('stage_only',)], Mismatched keys: [(('step',), <class 'int'>, <class 'int'>)]")
    assert "'step': differs from rank 0's value on ranks [1]" in warn0[0]
    assert "'stage_only': not on rank 0, only on ranks [1]" in warn0[0]
    assert "'lr'" not in warn0[0]
    assert (step0, step1, extra0, extra1) == (5, 5, False, False)  # rank 0's copy was saved
    assert (w0, w1) == ([0.0, 0.0], [1.0, 1.0])


def _diverging_common_saves_sharing_a_cache(rank, world, path):
    """Saves through one SavePlanCache (as the Lightning plugin and strategies make them): the same differing
    paths are said once, at the first save; a new difference is said again; values still rank 0's."""
    import logging

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("lightning_distckpt").addHandler(handler)
    cache, said = SavePlanCache(), []
    for step, extra in ((5, False), (6, False), (7, False), (8, True)):
        common = {"best": f"ck-{step}-rank{rank}", **({"stage_only": 1} if extra and rank == 1 else {})}
        w = ldc.ShardedTensor.from_rank_offsets("w", torch.full((2,), float(step)), (0, rank, world))
        ldc.save({"w": w, **common}, path, plan_cache=cache)
        said.append(len([r for r in records if r.levelname == "WARNING"]))
    loaded = ldc.load({"w": ldc.ShardedTensor.from_rank_offsets("w", torch.zeros(2), (0, rank, world))}, path)
    return said, loaded["best"]


def test_common_state_differing_the_same_way_is_said_once_per_run(tmp_path):
    results = run_distributed(_diverging_common_saves_sharing_a_cache, 2, str(tmp_path / "ck"))
    for rank, (said, best) in enumerate(results):
        assert said == [1, 1, 1, 2], (rank, said)  # the first save, then the new difference only
        assert best == "ck-8-rank0"  # rank 0's copy is the one saved


def _unpicklable_common_save(rank, world, path):
    # Only rank 0 holds a value torch.save cannot serialize: every rank must fail, nobody waits.
    sd = {"w": ldc.ShardedTensor.from_rank_offsets("w", torch.zeros(2), (0, rank, world)),
          "cfg": {"hooks": [None, (lambda x: x) if rank == 0 else None]}}
    try:
        ldc.save(sd, path)
    except ldc.CheckpointingError as e:
        return str(e)
    return None


def test_unserializable_common_state_fails_on_every_rank(tmp_path):
    msgs = run_distributed(_unpicklable_common_save, 2, str(tmp_path / "ck"), timeout_s=60)
    for msg in msgs:
        assert msg is not None and "rank 0" in msg and "cannot be serialized" in msg
        assert "(the value at 'cfg/hooks/1')" in msg  # where it is, not only what pickle says of it
    assert not (tmp_path / "ck").exists()
