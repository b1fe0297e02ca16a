"""Checksums on everything stored (format 3): one flipped byte anywhere in a data file, an object,
the common state or metadata.json is an error on load and a named problem in validate, never
wrong values; older checkpoints load with one warning; LIGHTNING_DISTCKPT_VERIFY=0 turns the
checks of objects, common state and metadata off."""

import json
import logging
import os
import shutil

import pytest
import torch

import lightning_distckpt as ldc
from lightning_distckpt.cli import main
from lightning_distckpt import validate
from lightning_distckpt.core.errors import FormatError

W = torch.arange(64 * 300, dtype=torch.float32).reshape(64, 300)
NORM = torch.linspace(0, 1, 300)


def state():
    return {"w": ldc.ShardedTensor.from_rank_offsets("w", W.clone()),
            "norm": ldc.ShardedTensor.from_rank_offsets("norm", NORM.clone()),
            "o": ldc.ShardedObject("o", {"seed": 1234, "name": "x" * 200}, (1,), (0,)), "step": 17}


def template():
    return {"w": ldc.ShardedTensor.from_rank_offsets("w", torch.zeros(64, 300)),
            "norm": ldc.ShardedTensor.from_rank_offsets("norm", torch.zeros(300)),
            "o": ldc.ShardedObject("o", None, (1,), (0,))}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("sums")
    out = {}
    for layout in ("ocdbt", "zarr"):
        out[layout] = str(root / layout)
        ldc.save(state(), out[layout], storage=ldc.StorageOptions(layout=layout, chunk_bytes=16 << 10,
                                                                   pack_max_bytes=4096))
    return out


def copy(src, tmp_path):
    dst = str(tmp_path / "ck")
    shutil.copytree(src, dst)
    return dst


def flip(path, where):
    data = bytearray(open(path, "rb").read())
    pos = {"middle": len(data) // 2, "end": len(data) - 1}[where]
    data[pos] ^= 0x20
    with open(path, "wb") as f:
        f.write(bytes(data))


def data_files(ck):
    return sorted((os.path.join(d, f) for d, _, fs in os.walk(os.path.join(ck, "data")) for f in fs),
                  key=os.path.getsize)


def assert_loads_exactly(ck):
    out = ldc.load(template(), ck)
    assert torch.equal(out["w"], W) and torch.equal(out["norm"], NORM) and out["o"]["seed"] == 1234


@pytest.mark.parametrize("direct", ["1", "0"])  # our direct chunk reads, or tensorstore's
@pytest.mark.parametrize("layout", ["ocdbt", "zarr"])
@pytest.mark.parametrize("where", ["middle", "end"])
def test_a_flipped_byte_in_the_largest_data_file_is_detected(saved, tmp_path, layout, where, direct, monkeypatch):
    monkeypatch.setenv("LIGHTNING_DISTCKPT_DIRECT_READS", direct)
    ck = copy(saved[layout], tmp_path)
    victim = data_files(ck)[-1]
    flip(victim, where)
    try:
        assert_loads_exactly(ck)
    except ldc.CheckpointingError:
        report = validate(ck)
        assert not report.ok and any("Digest mismatch" in p or "checksum" in p.lower() for p in report.problems), \
            report.problems
        if layout == "zarr":  # a file per chunk: the problem names it
            assert any(os.path.relpath(victim, ck) in p for p in report.problems), report.problems
        return
    # Only the end of an OCDBT data file may hold bytes no read touches (by all appearances b-tree
    # nodes superseded during the save; the data read was exact, checked above). Chunks are always caught.
    assert layout == "ocdbt" and where == "end", "a flipped byte loaded without error"
    assert validate(ck).ok


def test_every_data_file_of_the_zarr_layout_is_covered(saved, tmp_path):
    """A flipped byte in any chunk file (arrays, the pack of small shards) or its zarr.json is an error."""
    for i, rel in enumerate(os.path.relpath(f, saved["zarr"]) for f in data_files(saved["zarr"])):
        ck = copy(saved["zarr"], tmp_path / str(i))
        flip(os.path.join(ck, rel), "middle")
        try:
            assert_loads_exactly(ck)
        except ldc.CheckpointingError:
            continue
        raise AssertionError(f"a flipped byte in {rel} loaded without error")


def test_objects_common_state_and_metadata_are_verified(saved, tmp_path):
    ck = copy(saved["zarr"], tmp_path)
    obj = [f for f in data_files(ck) if f"{os.sep}o{os.sep}" in f][0]
    flip(obj, "end")
    with pytest.raises(FormatError, match="object 'o'.*checksum mismatch"):
        assert_loads_exactly(ck)
    assert any("object 'o'" in p and "checksum mismatch" in p for p in validate(ck).problems)
    ck = copy(saved["ocdbt"], tmp_path / "c")
    flip(os.path.join(ck, "common.pt"), "middle")
    with pytest.raises(FormatError, match="common.pt: checksum mismatch"):
        ldc.load_common_state_dict(ck)
    assert any("common.pt: checksum mismatch" in p for p in validate(ck).problems)
    ck = copy(saved["ocdbt"], tmp_path / "m")
    meta = open(os.path.join(ck, "metadata.json")).read()
    meta = meta.replace('"world_size": 1', '"world_size": 2')  # valid JSON, plausible, wrong
    open(os.path.join(ck, "metadata.json"), "w").write(meta)
    with pytest.raises(FormatError, match="metadata.json: checksum mismatch"):
        assert_loads_exactly(ck)
    assert main(["validate", ck]) == 2


def test_verification_can_be_switched_off(saved, tmp_path, monkeypatch):
    ck = copy(saved["ocdbt"], tmp_path)
    meta = open(os.path.join(ck, "metadata.json")).read().replace('"world_size": 1', '"world_size": 2')
    open(os.path.join(ck, "metadata.json"), "w").write(meta)
    monkeypatch.setenv("LIGHTNING_DISTCKPT_VERIFY", "0")
    assert_loads_exactly(ck)


def test_checkpoints_without_checksums_load_with_one_warning(tmp_path, caplog, capsys):
    ck = tmp_path / "v2"
    ldc.save(state(), ck, storage=ldc.StorageOptions(layout="zarr"))
    for array in ck.rglob("zarr.json"):  # the arrays as a format 2 save wrote them: no save token (format 7)
        array_meta = json.loads(array.read_text())
        record = array_meta["attributes"]["lightning_distckpt"]
        del record["save"]
        if not record:  # the token was all it recorded (the crc32c codec checksums its chunks)
            del array_meta["attributes"]
        array.write_text(json.dumps(array_meta))
    for obj in (ck / "data").glob("rank_*/o/*/*"):  # and its objects: stored without a header
        obj.write_bytes(obj.read_bytes()[20:])
    meta = json.loads((ck / "metadata.json").read_text())
    meta["format_version"] = 2
    (ck / "metadata.json").write_text(json.dumps(meta))
    marker = json.loads((ck / "COMMITTED").read_text())
    (ck / "COMMITTED").write_text(json.dumps({k: marker[k] for k in ("bytes", "world_size", "committed_unix")}))
    with caplog.at_level(logging.WARNING):
        assert_loads_exactly(ck)
        assert_loads_exactly(ck)
    warnings = [r for r in caplog.records if "carries no checksums" in r.getMessage()]
    assert len(warnings) == 1
    assert main(["validate", str(ck)]) == 0
    assert "written before checksums" in capsys.readouterr().out
    assert main(["validate", str(ck), "--require-checksums"]) == 1
    assert "PROBLEM" in capsys.readouterr().out


def test_a_format_3_marker_without_checksums_is_damage(saved, tmp_path):
    ck = copy(saved["ocdbt"], tmp_path)
    marker = json.loads(open(os.path.join(ck, "COMMITTED")).read())
    del marker["common_sha256"]
    open(os.path.join(ck, "COMMITTED"), "w").write(json.dumps(marker))
    with pytest.raises(FormatError, match="lacks the checksums"):
        assert_loads_exactly(ck)


def test_a_relayout_does_not_launder_damage(saved, tmp_path):
    """convert copies bytes: it verifies them first, so damage is not given fresh checksums."""
    from lightning_distckpt.convert import relayout_checkpoint

    ck = copy(saved["ocdbt"], tmp_path)
    flip(os.path.join(ck, "common.pt"), "middle")
    with pytest.raises(FormatError, match="common.pt: checksum mismatch"):
        relayout_checkpoint(ck, str(tmp_path / "copy"), ldc.StorageOptions(layout="zarr"))
    assert not os.path.exists(tmp_path / "copy")
    ck = copy(saved["zarr"], tmp_path / "d")
    flip(data_files(ck)[-1], "middle")
    with pytest.raises(ldc.CheckpointingError):
        relayout_checkpoint(ck, str(tmp_path / "copy"), ldc.StorageOptions(layout="ocdbt"))
    assert not os.path.exists(tmp_path / "copy")


def _save_tp2(rank, world, path):
    rows = W.shape[0] // world
    sd = {"w": ldc.ShardedTensor.from_rank_offsets("w", W[rank * rows:(rank + 1) * rows].clone(), (0, rank, world))}
    ldc.save(sd, path, storage=ldc.StorageOptions(layout="zarr", chunk_bytes=16 << 10, pack_max_bytes=0))
    return True


def _load_tp2(rank, world, path, loader):
    rows = W.shape[0] // world
    sd = {"w": ldc.ShardedTensor.from_rank_offsets("w", torch.zeros(rows, 300), (0, rank, world))}
    try:
        ldc.load(sd, path, loader=loader)
    except ldc.CheckpointingError as e:
        return type(e).__name__, str(e)
    return None


@pytest.mark.parametrize("loader", ["every_rank", "two_stage"])
def test_damage_read_by_one_rank_fails_the_load_on_every_rank(tmp_path, loader):
    from dist_utils import run_distributed

    path = str(tmp_path / "ck")
    run_distributed(_save_tp2, 2, path)
    victim = [f for f in data_files(path) if "rank_00001" in f and f.endswith(os.path.join("c", "0", "0"))][0]
    flip(victim, "middle")  # a chunk only rank 1's shard holds
    results = run_distributed(_load_tp2, 2, path, loader)
    assert all(r is not None for r in results), results  # no rank returned normally, none hung
    # "checksum mismatch": our direct chunk reads (storage/direct_read.py); "Digest mismatch": tensorstore's
    assert all(("checksum mismatch" in r[1] or "Digest mismatch" in r[1]) and "rank 1" in r[1] for r in results), \
        results
