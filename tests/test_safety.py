"""Safety of what a save replaces and of what a load trusts: a save never removes files that are
not a committed checkpoint of ours; paths with a URL scheme are refused; nothing under a checkpoint
is followed through a symbolic link; malformed metadata is a FormatError naming the field."""

import json
import os

import pytest
import torch

import lightning_distckpt as ldc


def state(value=1.0):
    return {"w": ldc.ShardedTensor.from_rank_offsets("w", torch.full((64,), value)), "step": 3}


def template():
    return {"w": ldc.ShardedTensor.from_rank_offsets("w", torch.zeros(64))}


# -- never destroy what is not ours --------------------------------------------------------------
@pytest.mark.parametrize("contents", [["data/"], ["data/", "data/rank_00000/", "notes.txt"],
                                      ["metadata.json"], ["COMMITTED", "data/"], ["notes.txt"]])
def test_save_refuses_a_directory_that_is_not_a_committed_checkpoint(tmp_path, contents):
    target = tmp_path / "ck"
    target.mkdir()
    for name in contents:
        if name.endswith("/"):
            (target / name).mkdir()
        else:
            (target / name).write_text("the user's")
    (target / "data" if (target / "data").is_dir() else target).joinpath("precious.txt").write_text("mine")
    before = sorted(str(p.relative_to(target)) for p in target.rglob("*"))
    with pytest.raises(ldc.CheckpointingError, match="refusing to replace"):
        ldc.save(state(), target)
    assert sorted(str(p.relative_to(target)) for p in target.rglob("*")) == before
    assert not [n for n in os.listdir(tmp_path) if n != "ck"]  # no staging directory left either


def test_save_replaces_a_committed_checkpoint_and_fills_an_empty_directory(tmp_path):
    (tmp_path / "empty").mkdir()
    ldc.save(state(1.0), tmp_path / "empty")
    ldc.save(state(2.0), tmp_path / "empty")
    assert torch.equal(ldc.load(template(), tmp_path / "empty")["w"], torch.full((64,), 2.0))
