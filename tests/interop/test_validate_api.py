"""``lightning_distckpt.validate(path)``: the Python entry point of ``lightning-distckpt validate``,
returning a typed :class:`~lightning_distckpt.ValidationReport` for our checkpoints and for PyTorch
DCP directories; bad arguments and missing checkpoints are CheckpointingErrors."""

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp

import lightning_distckpt as ldc


@pytest.fixture
def saved(tmp_path):
    """One process, zarr layout (each chunk a file of its own), a tensor of 2 chunks and an object."""
    path = str(tmp_path / "ck")
    sd = {"w": ldc.ShardedTensor.from_rank_offsets("w", torch.arange(4096.0).reshape(64, 64)),
          "rng": ldc.ShardedObject("rng", {"seed": 3}, (1,), (0,)), "step": 5}
    ldc.save(sd, path, storage=ldc.StorageOptions(layout="zarr", chunk_bytes=8192))
    return path


def _chunk_files(path):
    root = os.path.join(path, "data")
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs
                  if f != "zarr.json" and os.path.getsize(os.path.join(d, f)) >= 8192)


def test_intact_checkpoint_reports_ok(saved):
    seen = []
    report = ldc.validate(saved, on_key=seen.append)
    assert isinstance(report, ldc.validation.ValidationReport)
    assert report.ok and report.problems == [] and report.warnings == []
    assert report.path == saved and report.shards == 1 and report.objects == 1
    assert report.bytes_read >= 4096 * 4 and seen == ["w"]
    assert report.to_json()["ok"] is True and set(report.to_json()) >= {"problems", "warnings", "bytes_read"}


def test_a_flipped_byte_is_a_problem_naming_the_key(saved):
    chunk = _chunk_files(saved)[0]
    with open(chunk, "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xFF]))
    report = ldc.validate(saved)
    assert not report.ok
    assert any("'w'" in p for p in report.problems), report.problems


def test_a_dcp_directory_is_validated_by_its_zip_records_crcs(tmp_path):
    path = str(tmp_path / "dcp")
    dcp.save({"w": torch.arange(1024.0)}, checkpoint_id=path, no_dist=True)
    report = ldc.validate(path)
    assert report.ok and report.shards == 1
    assert any("no checksums of its own" in w and "CRC-32" in w for w in report.warnings)
    data_file = tmp_path / "dcp" / "__0_0.distcp"
    data = bytearray(data_file.read_bytes())
    data[data.index(torch.arange(1024.0).numpy().tobytes()) + 2048] ^= 0x01  # w[512]
    data_file.write_bytes(data)
    report = ldc.validate(path)
    assert not report.ok and any("'w'" in p and "CRC-32" in p for p in report.problems), report.problems


def test_bad_arguments_and_missing_checkpoints_are_checkpointing_errors(saved, tmp_path):
    with pytest.raises(ldc.ArgumentTypeError, match="require_checksums"):
        ldc.validate(saved, require_checksums="yes")
    with pytest.raises(ldc.ArgumentError, match="max_inflight_bytes"):
        ldc.validate(saved, max_inflight_bytes=0)
    with pytest.raises(ldc.ArgumentTypeError):
        ldc.validate(5)
    with pytest.raises(ldc.CheckpointNotFoundError):
        ldc.validate(str(tmp_path / "nothing"))
