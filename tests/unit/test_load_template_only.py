"""``load(..., common=False)``: the template's leaves only; the common state is not read unless the
template's own plain tensors are kept in it."""

import os

import pytest
import torch

import lightning_distckpt as ldc
from lightning_distckpt.core.errors import ArgumentTypeError

W = torch.arange(12.0).reshape(3, 4)


def _template() -> dict:
    return {"model": {"w": ldc.ShardedTensor.from_rank_offsets("model.w", torch.zeros_like(W))}}


@pytest.fixture
def saved(tmp_path):
    path = str(tmp_path / "ck")
    ldc.save({"model": {"w": ldc.ShardedTensor.from_rank_offsets("model.w", W.clone())},
              "step": 7, "opt": {"lr": 0.5}, "extra": torch.tensor([1.0, 2.0])}, path)
    return path


def test_only_the_template_leaves_come_back(saved):
    everything = ldc.load(_template(), saved)
    assert everything["step"] == 7 and everything["opt"] == {"lr": 0.5} and torch.equal(everything["extra"],
                                                                                      torch.tensor([1.0, 2.0]))
    only = ldc.load(_template(), saved, common=False)
    assert set(only) == {"model"} and set(only["model"]) == {"w"} and torch.equal(only["model"]["w"], W)


def test_the_common_state_is_not_read(saved):
    # common.pt damaged: a load that reads it fails on its checksum; one that does not, succeeds
    with open(os.path.join(saved, "common.pt"), "r+b") as f:
        f.seek(40)
        byte = f.read(1)
        f.seek(40)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(ldc.CheckpointingError, match="common.pt"):
        ldc.load(_template(), saved)
    assert torch.equal(ldc.load(_template(), saved, common=False)["model"]["w"], W)


def test_plain_tensors_kept_in_the_common_state_are_still_filled(tmp_path):
    # AsyncSaver.save keeps plain tensors in the common state (as checkpoints before format 6 did)
    path = str(tmp_path / "ck")
    saver = ldc.AsyncSaver()
    saver.save({"model": {"w": ldc.ShardedTensor.from_rank_offsets("model.w", W.clone())},
                "s": torch.tensor(3.0), "note": "x"}, path).finalize()
    assert "s" not in ldc.reading.open_checkpoint(path).index.tensors  # kept in the common state
    template = {**_template(), "s": torch.zeros(())}
    out = ldc.load(template, path, common=False)
    assert set(out) == {"model", "s"} and out["s"].item() == 3.0 and torch.equal(out["model"]["w"], W)
    assert out["s"] is template["s"]  # read into the template's own tensor


def test_common_must_be_a_bool(saved):
    with pytest.raises(ArgumentTypeError, match="common"):
        ldc.load(_template(), saved, common="no")
