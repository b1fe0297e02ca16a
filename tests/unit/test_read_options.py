"""Verification and direct reads are a reader's options (``StorageOptions.verify`` /
``direct_reads``, passed to ``load(..., storage=...)``), per call; the environment variables
remain process-wide overrides that can only turn them off."""

from __future__ import annotations

import json
import os

import pytest
import torch

import lightning_distckpt as ldc
from lightning_distckpt.reading.checkpoint import OpenedCheckpoint
from lightning_distckpt.storage.layout import COMMIT_MARKER
from lightning_distckpt.storage.options import StorageOptions


def _saved(tmp_path) -> str:
    path = str(tmp_path / "ck")
    ldc.save({"w": ldc.ShardedTensor.from_rank_offsets("w", torch.arange(64.0).reshape(8, 8)), "step": 7}, path)
    return path


def _template() -> dict:
    return {"w": ldc.ShardedTensor.from_rank_offsets("w", torch.empty(8, 8))}


def test_verify_is_a_per_call_option(tmp_path, monkeypatch):
    monkeypatch.delenv("LIGHTNING_DISTCKPT_VERIFY", raising=False)
    path = _saved(tmp_path)
    marker_file = os.path.join(path, COMMIT_MARKER)
    with open(marker_file) as f:
        marker = json.load(f)
    marker["common_sha256"] = "0" * 64  # common.pt no longer matches what the marker records
    with open(marker_file, "w") as f:
        json.dump(marker, f)
    with pytest.raises(ldc.FormatError, match="common.pt: checksum mismatch"):
        ldc.load(_template(), path)
    loaded = ldc.load(_template(), path, storage=StorageOptions(verify=False))  # salvage: this call only
    assert loaded["step"] == 7 and torch.equal(loaded["w"], torch.arange(64.0).reshape(8, 8))
    with pytest.raises(ldc.FormatError, match="checksum mismatch"):
        ldc.load(_template(), path)  # the next call verifies again


def test_direct_reads_are_a_per_call_option_and_the_environment_only_turns_them_off(tmp_path, monkeypatch):
    monkeypatch.delenv("LIGHTNING_DISTCKPT_DIRECT_READS", raising=False)
    path = _saved(tmp_path)
    assert OpenedCheckpoint.open(path).reader().direct is not None
    assert OpenedCheckpoint.open(path, StorageOptions(direct_reads=False)).reader().direct is None
    loaded = ldc.load(_template(), path, storage=StorageOptions(direct_reads=False))
    assert torch.equal(loaded["w"], torch.arange(64.0).reshape(8, 8))
    monkeypatch.setenv("LIGHTNING_DISTCKPT_DIRECT_READS", "0")
    assert OpenedCheckpoint.open(path, StorageOptions(direct_reads=True)).reader().direct is None


def test_the_options_are_checked_and_never_recorded(tmp_path):
    with pytest.raises(ldc.ConfigError, match="verify must be a bool"):
        StorageOptions(verify="no")
    with pytest.raises(ldc.ArgumentTypeError):
        ldc.load(_template(), _saved(tmp_path), storage={"verify": False})
    with open(os.path.join(str(tmp_path / "ck"), "metadata.json")) as f:
        assert set(json.load(f)["storage"]) == {"backend", "layout", "chunk_bytes"}
