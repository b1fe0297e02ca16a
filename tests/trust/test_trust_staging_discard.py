"""A directory of ours that cannot be removed is named in a warning, with what is left in it (before:
``rmtree(ignore_errors=True)`` left it silently): a failed save's staging directory (it looked like a killed
save's), the previous checkpoint a save replaced (it kept its space, unnamed)."""

import logging
import os
import shutil
import subprocess

import pytest
import torch

import lightning_distckpt as ldc
from lightning_distckpt.storage import remove_tree, staging


def _pin(path: str) -> bool:
    """Make ``path``'s entries unremovable: immutable as root (where chattr works), read-only otherwise."""
    if os.geteuid() != 0:
        os.chmod(path, 0o500)
        return True
    if shutil.which("chattr") is None:
        return False
    return subprocess.run(["chattr", "+i", path], capture_output=True).returncode == 0


def _unpin(path: str) -> None:
    if os.geteuid() == 0:
        subprocess.run(["chattr", "-i", path], capture_output=True)
    os.chmod(path, 0o700)


def test_a_staging_directory_that_cannot_be_removed_is_named(tmp_path, caplog):
    stuck = staging.new_staging_dir(str(tmp_path / "ckpt"))
    os.makedirs(os.path.join(stuck, "data", "rank_00001"))
    with open(os.path.join(stuck, "data", "rank_00001", "chunk"), "wb") as f:
        f.write(b"x")
    pinned = os.path.join(stuck, "data", "rank_00001")
    if not _pin(pinned):
        pytest.skip("no way to make an entry unremovable here (chattr missing or refused)")
    try:
        with caplog.at_level(logging.WARNING, logger=remove_tree.__name__):
            staging.discard(stuck)
        assert os.path.isdir(stuck)
        said = [r.getMessage() for r in caplog.records if r.name == remove_tree.__name__]
        assert len(said) == 1, said
        assert f"could not remove the staging directory {stuck} of a failed save" in said[0]
        assert "rank_00001" in said[0] and "chunk" in said[0]  # the entry that failed, and what is left
        assert "left in it: ['data']" in said[0]
    finally:
        _unpin(pinned)
    staging.discard(stuck)  # removable again: removed, and nothing more said
    assert not os.path.lexists(stuck)


def test_a_removable_staging_directory_goes_quietly(tmp_path, caplog):
    gone = staging.new_staging_dir(str(tmp_path / "ckpt"))
    os.makedirs(os.path.join(gone, "data", "rank_00000"))
    with caplog.at_level(logging.WARNING, logger=remove_tree.__name__):
        staging.discard(gone)
    assert not os.path.lexists(gone)
    assert not [r for r in caplog.records if r.name == remove_tree.__name__]


def test_a_replaced_checkpoint_that_cannot_be_removed_is_named_and_the_new_one_is_in_place(tmp_path, caplog):
    path = str(tmp_path / "ckpt")
    ldc.save({"w": ldc.ShardedTensor.from_rank_offsets("w", torch.zeros(4))}, path)
    pinned = os.path.join(path, "data")
    if not _pin(pinned):
        pytest.skip("no way to make an entry unremovable here (chattr missing or refused)")
    try:
        with caplog.at_level(logging.WARNING, logger=remove_tree.__name__):
            ldc.save({"w": ldc.ShardedTensor.from_rank_offsets("w", torch.arange(4.0))}, path)
        got = ldc.load({"w": ldc.ShardedTensor.from_rank_offsets("w", torch.empty(4))}, path)["w"]
        assert torch.equal(got, torch.arange(4.0))  # the new checkpoint is the one in place
        said = [r.getMessage() for r in caplog.records if r.name == remove_tree.__name__]
        assert len(said) == 1 and "could not remove the previous checkpoint" in said[0], said
        aside = said[0].split("could not remove the previous checkpoint ")[1].split(",")[0]
        assert os.path.dirname(aside) == str(tmp_path) and aside != path and os.path.isdir(aside), said
        assert "left in it: ['data']" in said[0]
    finally:
        for name in os.listdir(tmp_path):  # the pinned directory moved aside with the old checkpoint
            if os.path.isdir(os.path.join(tmp_path, name, "data")):
                _unpin(os.path.join(tmp_path, name, "data"))
