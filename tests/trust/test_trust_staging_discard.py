"""A failed save's staging directory that cannot be removed is named in a warning, with what is left in it
(before: ``rmtree(ignore_errors=True)`` left it silently, to look like a killed save's)."""

import logging
import os
import shutil
import subprocess

import pytest

from lightning_distckpt.storage import staging


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
        with caplog.at_level(logging.WARNING, logger=staging.__name__):
            staging.discard(stuck)
        assert os.path.isdir(stuck)
        said = [r.getMessage() for r in caplog.records if r.name == staging.__name__]
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
    with caplog.at_level(logging.WARNING, logger=staging.__name__):
        staging.discard(gone)
    assert not os.path.lexists(gone)
    assert not [r for r in caplog.records if r.name == staging.__name__]
