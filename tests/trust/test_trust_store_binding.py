"""A rank store (or a part of one) copied in from another checkpoint of the same layout is refused.

Each rank store keeps its own chunk checksums and its objects' checksums, and metadata.json used to
describe the stores by layout alone, so another checkpoint's store (one rank's directory synced from
another run, a restore from the wrong backup, a re-save's older copy) passed every check and loaded
its values as this checkpoint's. Since format 7 a save's token is recorded in metadata.json, in
every array's zarr.json and in every object's checksum (``storage/save_token.py``).
"""

import hashlib
import json
import os
import shutil

import pytest
import torch

import lightning_distckpt as ldc
from lightning_distckpt.convert import relayout_checkpoint
from lightning_distckpt.core.errors import CheckpointingError
from lightning_distckpt.storage.layout import COMMIT_MARKER, METADATA_FILE, object_path, pack_path, tensor_path

LAYOUTS = {"ocdbt": ldc.StorageOptions(), "zarr": ldc.StorageOptions(layout="zarr")}


def _state(value: float) -> dict:
    return {
        "big": ldc.ShardedTensor.from_rank_offsets("big", torch.full((512, 256), value)),  # an array of its own
        "bias": ldc.ShardedTensor.from_rank_offsets("bias", torch.full((8,), value)),  # packed
        "obj": ldc.ShardedObject("obj", {"value": value}, (1,), (0,)),
    }


def _template() -> dict:
    return {"big": ldc.ShardedTensor.from_rank_offsets("big", torch.zeros(512, 256)),
            "bias": ldc.ShardedTensor.from_rank_offsets("bias", torch.zeros(8)),
            "obj": ldc.ShardedObject("obj", None, (1,), (0,))}


def _two(tmp_path, layout):
    a, b = str(tmp_path / "A"), str(tmp_path / "B")
    ldc.save(_state(1.0), a, storage=LAYOUTS[layout])
    ldc.save(_state(2.0), b, storage=LAYOUTS[layout])
    return a, b


def _copy_from(b, a, part=""):
    """Replace ``part`` of A's rank-0 store (all of it when empty) with B's."""
    src, dst = (os.path.join(p, "data", "rank_00000", part) for p in (b, a))
    shutil.rmtree(dst)
    shutil.copytree(src, dst)


@pytest.mark.parametrize("direct", ["0", "1"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_rank_store_from_another_checkpoint_is_refused(tmp_path, monkeypatch, layout, direct):
    monkeypatch.setenv("LIGHTNING_DISTCKPT_DIRECT_READS", direct)
    a, b = _two(tmp_path, layout)
    assert torch.equal(ldc.load(_template(), a)["big"], torch.full((512, 256), 1.0))
    _copy_from(b, a)
    with pytest.raises(CheckpointingError, match="written by another save") as e:
        ldc.load(_template(), a)
    assert "rank_00000" in str(e.value) or "rank 0" in str(e.value)
    report = ldc.validate(a)
    assert not report.ok and any("another save" in p for p in report.problems)


@pytest.mark.parametrize("part, key", [(tensor_path("big", 0), "big"), (pack_path("float32"), "bias")])
def test_one_array_from_another_checkpoint_is_refused(tmp_path, part, key):
    a, b = _two(tmp_path, "zarr")  # a file per chunk: one array's directory can be swapped alone
    _copy_from(b, a, part)
    with pytest.raises(CheckpointingError, match="written by another save"):
        ldc.load({key: _template()[key]}, a)
    assert ldc.load({"obj": _template()["obj"]}, a)["obj"] == {"value": 1.0}  # the rest is still A's


def test_an_object_from_another_checkpoint_fails_its_checksum(tmp_path):
    a, b = _two(tmp_path, "zarr")
    name = object_path("obj", 0)
    shutil.copyfile(os.path.join(b, "data", "rank_00000", name), os.path.join(a, "data", "rank_00000", name))
    with pytest.raises(CheckpointingError, match="checksum mismatch.*another save"):
        ldc.load({"obj": _template()["obj"]}, a)
    assert torch.equal(ldc.load({"big": _template()["big"]}, a)["big"], torch.full((512, 256), 1.0))


def test_each_save_and_relayout_has_its_own_token_and_loads(tmp_path):
    a, b = _two(tmp_path, "ocdbt")
    tokens = [json.load(open(os.path.join(p, "metadata.json")))["save_token"] for p in (a, b)]
    assert tokens[0] != tokens[1]
    out = str(tmp_path / "A-zarr")
    relayout_checkpoint(a, out, LAYOUTS["zarr"])
    assert json.load(open(os.path.join(out, "metadata.json")))["save_token"] not in tokens
    loaded = ldc.load(_template(), out)
    assert torch.equal(loaded["big"], torch.full((512, 256), 1.0)) and loaded["obj"] == {"value": 1.0}
    assert ldc.validate(out).ok


def test_a_malformed_token_in_metadata_is_a_format_error(tmp_path):
    a, _ = _two(tmp_path, "ocdbt")
    meta = json.load(open(os.path.join(a, METADATA_FILE)))
    meta["save_token"] = "../../etc"
    text = json.dumps(meta).encode()
    with open(os.path.join(a, METADATA_FILE), "wb") as f:
        f.write(text)
    marker = json.load(open(os.path.join(a, COMMIT_MARKER)))
    marker["metadata_sha256"] = hashlib.sha256(text).hexdigest()  # a consistent lie: only the field is wrong
    with open(os.path.join(a, COMMIT_MARKER), "w") as f:
        json.dump(marker, f)
    with pytest.raises(CheckpointingError, match="save_token must be 16 hexadecimal digits"):
        ldc.load(_template(), a)
