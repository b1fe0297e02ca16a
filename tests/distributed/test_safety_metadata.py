"""metadata.json is data, checked as data: every malformed field is a FormatError naming it (the
command line answers one line, exit status 2, no traceback); sizes the index claims are checked
against the bytes stored before anything is allocated; damaged common state and wrong argument types
raise library errors, not IndexError / AttributeError."""

import hashlib
import json
import os
import subprocess
import sys

import pytest
import torch

import lightning_distckpt as ldc
from lightning_distckpt.cli import main
from lightning_distckpt.core.errors import FormatError, ShardingError, UnsafeContentError
from lightning_distckpt.storage.safe_pickle import dumps, loads

DEEP = "[" * 10000 + "]" * 10000


def _save(tmp_path, name="ck"):
    sd = {"w": ldc.ShardedTensor.from_rank_offsets("w", torch.arange(64.0)),
          "o": ldc.ShardedObject("o", {"x": 1}, (1,), (0,)), "step": 3}
    ldc.save(sd, tmp_path / name, storage=ldc.StorageOptions(pack_max_bytes=0))
    return tmp_path / name


def _mutate(ck, fn):
    path = ck / "metadata.json"
    meta = json.loads(path.read_text())
    fn(meta)
    raw = json.dumps(meta).replace('"__DEEP__"', DEEP).encode()
    path.write_bytes(raw)
    marker = json.loads((ck / "COMMITTED").read_text())  # self-consistent: the fields are what is wrong
    marker["metadata_sha256"] = hashlib.sha256(raw).hexdigest()
    (ck / "COMMITTED").write_text(json.dumps(marker))


def _set(path, value):
    def fn(meta):
        node = meta
        for part in path[:-1]:
            node = node[part]
        node[path[-1]] = value
    return fn


w0 = ["tensors", "w", "shards", 0]
CASES = {
    "storage": (_set(["storage"], [1, 2]), "storage"),
    "storage.chunk_bytes": (_set(["storage", "chunk_bytes"], "lots"), "storage.chunk_bytes"),
    "storage.layout": (_set(["storage", "layout"], "tape"), "storage.layout"),
    "deep extra field": (_set(["extra"], "__DEEP__"), "nested 1000"),
    "deep tensors": (_set(["tensors"], "__DEEP__"), "nested 1000"),
    "format_version": (_set(["format_version"], True), "format version"),
    "world_size": (_set(["world_size"], "two"), "world_size"),
    "tensors": (_set(["tensors"], []), "tensors"),
    "dtype": (_set(["tensors", "w", "dtype"], "complex1024"), "tensors['w'].dtype"),
    "global_shape 1e30": (_set(["tensors", "w", "global_shape"], [10**30]), "tensors['w'].global_shape"),
    "global_shape float": (_set(["tensors", "w", "global_shape"], [64.0]), "tensors['w'].global_shape"),
    "shards": (_set(["tensors", "w", "shards"], {"0": 1}), "tensors['w'].shards"),
    "writer": (_set(w0 + ["writer"], "../../etc"), "tensors['w'].shards[0].writer"),
    "offset": (_set(w0 + ["offset"], [60]), "tensors['w'].shards[0]"),
    "offset rank": (_set(w0 + ["offset"], [0, 0]), "tensors['w'].shards[0].offset"),
    "flat": (_set(w0 + ["flat"], [5, 500]), "tensors['w'].shards[0].flat"),
    "object offset": (_set(["objects", "o", "shards", 0, "offset"], [3]), "objects['o'].shards[0].offset"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_malformed_metadata_is_a_format_error_naming_the_field(tmp_path, capsys, case):
    fn, field = CASES[case]
    ck = _save(tmp_path)
    _mutate(ck, fn)
    template = {"w": ldc.ShardedTensor.from_rank_offsets("w", torch.zeros(64))}
    with pytest.raises(FormatError) as err:
        ldc.load(template, ck)
    assert field in str(err.value)
    with pytest.raises(FormatError, match="metadata.json"):
        ldc.load_plain_tensors(ck)
    for command in ("inspect", "validate"):  # in process: main() itself must not raise
        assert main([command, str(ck)]) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and field in err, err


@pytest.mark.parametrize("shape", [[10**12], [10**6, 10**6]])
def test_huge_claimed_shapes_are_checked_against_the_stored_bytes_before_allocating(tmp_path, shape):
    ck = _save(tmp_path)

    def claim(meta):
        meta["tensors"]["w"]["global_shape"] = shape
        meta["tensors"]["w"]["shards"][0]["shape"] = shape
        meta["tensors"]["w"]["shards"][0]["offset"] = [0] * len(shape)
    _mutate(ck, claim)
    with pytest.raises(FormatError, match=r"claims \d+ bytes of tensor data in it, but its files hold only"):
        ldc.load_plain_tensors(ck)  # would allocate 4 TB
    from lightning_distckpt import validate

    report = validate(str(ck))
    assert not report.ok and any("claims" in p for p in report.problems)


def test_empty_or_unreadable_common_state(tmp_path):
    ck = _save(tmp_path)
    (ck / "common.pt").write_bytes(b"")
    with pytest.raises(FormatError, match="common.pt is empty"):
        ldc.load_common_state_dict(ck)
    os.remove(ck / "common.pt")
    (ck / "common.pt").mkdir()  # present but no file to read (as root, chmod 000 would still read)
    with pytest.raises(ldc.CheckpointingError, match="common.pt is a directory, not a regular file"):
        ldc.load_common_state_dict(ck)
    os.rmdir(ck / "common.pt")
    with pytest.raises(ldc.CheckpointingError, match="common.pt is missing"):
        ldc.load_common_state_dict(ck)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_common_state_without_read_permission(tmp_path):
    ck = _save(tmp_path)
    os.chmod(ck / "common.pt", 0)
    with pytest.raises(ldc.CheckpointingError, match="common.pt cannot be read"):
        ldc.load_common_state_dict(ck)


def test_a_list_as_sharded_tensor_data_is_a_sharding_error():
    with pytest.raises(ShardingError, match="'w': data must be a torch.Tensor, got list"):
        ldc.ShardedTensor.from_rank_offsets("w", [1.0, 2.0])
    with pytest.raises(ShardingError, match="got list"):
        ldc.ShardedTensor.from_rank_offsets_flat("w", [1.0, 2.0], (4,), flattened_range=slice(0, 2))
    with pytest.raises(ShardingError, match="got tuple"):
        ldc.ShardedTensor.from_offsets("w", (1.0,), (4,), (0,))


class Unlisted:
    pass


def test_refused_types_and_damaged_archives_are_told_apart_by_type():
    with pytest.raises(UnsafeContentError):
        loads(dumps(Unlisted()), "blob")
    with pytest.raises(FormatError) as err:
        loads(dumps({"a": torch.ones(3)})[:-30], "blob")
    assert not isinstance(err.value, UnsafeContentError)


def test_the_console_script_answers_one_line_without_traceback(tmp_path):
    ck = _save(tmp_path)
    _mutate(ck, _set(["storage", "chunk_bytes"], "lots"))
    res = subprocess.run([sys.executable, "-m", "lightning_distckpt", "validate", str(ck)], capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 2 and "Traceback" not in res.stderr and len(res.stderr.strip().splitlines()) == 1
    assert "storage.chunk_bytes" in res.stderr
