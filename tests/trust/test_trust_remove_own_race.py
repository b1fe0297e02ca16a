"""Removing one of our checkpoints removes what was checked, never a user's directory swapped in meanwhile.

``LocalStore.remove`` (``ModelCheckpoint``'s top-k rotation through ``DistCheckpointIO.remove_checkpoint``,
``open_store(p).remove()``) checked that the name held a checkpoint of ours, then removed ``COMMITTED`` in
whatever directory was at the name by then, renamed that aside and deleted it whole unchecked: a user's
directory moved to the name in between was lost. Now the directory is renamed aside first (a removal's own
staging name, ``.removed``) and checked again there; only ours goes, anything else is put back (or left at
the aside name when the name is taken again) and named. A removal interrupted after the rename leaves a
committed checkpoint at that aside name: it is a removal's leftover (``clean`` removes it), never a stranded
commit that a load, ``inspect`` or ``clean`` renames back into place. The swaps happen right after the check
(``removable``) or at the second look (``is_checkpoint_dir`` on the aside), as another process would."""

from __future__ import annotations

import contextlib
import io
import os

import pytest
import torch

import lightning_distckpt as ldc
from lightning_distckpt.cli.clean import clean
from lightning_distckpt.cli.main import main
from lightning_distckpt.core.errors import ArgumentError, CheckpointNotFoundError
from lightning_distckpt.lightning import DistCheckpointIO
from lightning_distckpt.storage import local_store, staging, staging_names
from lightning_distckpt.storage.commit import recover_interrupted_commit
from lightning_distckpt.storage.layout import is_committed
from lightning_distckpt.storage.stores import open_store
from user_files import tree_digest, users_dir


def save_ours(path) -> str:
    ldc.save({"w": ldc.ShardedTensor.from_rank_offsets("w", torch.arange(6.0)), "step": 1}, str(path))
    assert is_committed(str(path))
    return str(path)


def loads(path) -> bool:
    return set(ldc.load_tensors_metadata(path)) == {"w"}


REMOVERS = {"store": lambda p: open_store(p).remove(), "checkpoint_io": DistCheckpointIO().remove_checkpoint}


def swap_at(monkeypatch, seam: str, target: str, moved: str, mine: str) -> None:
    """Move our checkpoint at ``target`` to ``moved`` and the user's ``mine`` to its name, as another process
    would: right after the removal's check (``removable``), or right before its rename, as the aside name is
    chosen (``new_staging_dir``, after every look at the name)."""
    def swap() -> None:
        os.rename(target, moved)
        os.rename(mine, target)

    if seam == "after_the_check":
        real_removable = local_store.removable

        def removable_then_swap(path):
            found = real_removable(path)
            swap()
            return found

        monkeypatch.setattr(local_store, "removable", removable_then_swap)
    else:
        real_new = staging_names.new_staging_dir

        def swap_then_name(path):
            if os.path.abspath(path) == target and os.path.lexists(mine):
                swap()
            return real_new(path)

        monkeypatch.setattr(staging_names, "new_staging_dir", swap_then_name)


@pytest.mark.parametrize("seam", ["after_the_check", "before_the_rename"])
@pytest.mark.parametrize("remover", sorted(REMOVERS))
def test_a_users_directory_moved_to_the_name_during_the_removal_is_kept(tmp_path, monkeypatch, remover, seam):
    """Our checkpoint found removable, then moved away and a user's directory moved to its name (another
    process) after the check or right before the rename: the removal refuses it, naming it, and puts it back
    whole (its COMMITTED file too); our moved checkpoint is untouched (its marker too) and nothing is left aside.
    Before: at the rename the user's directory was deleted whole, and our moved checkpoint lost its marker."""
    target = save_ours(tmp_path / "step=1")
    moved = str(tmp_path / "kept_elsewhere")
    mine = users_dir(tmp_path / "mine")
    kept = tree_digest(mine)
    swap_at(monkeypatch, seam, target, moved, mine)
    with pytest.raises(ArgumentError, match=f"remove {target}: something other than a checkpoint of ours was put "
                                            f"at its name .* left as it is at {target}$"):
        REMOVERS[remover](target)
    monkeypatch.undo()
    assert os.path.isdir(target) and tree_digest(target) == kept
    assert sorted(os.listdir(tmp_path)) == ["kept_elsewhere", "step=1"]  # nothing aside
    assert is_committed(moved) and loads(moved)


def test_a_users_directory_stays_aside_when_the_name_is_taken_again(tmp_path, monkeypatch):
    """The name taken again before the user's directory can go back: it stays, whole, at the aside name the
    error names, and what took the name is not touched."""
    target = save_ours(tmp_path / "step=1")
    mine = users_dir(tmp_path / "mine")
    kept = tree_digest(mine)
    real_removable, real_is_ours = local_store.removable, local_store.is_checkpoint_dir

    def removable_then_swap(path):
        found = real_removable(path)
        os.rename(target, str(tmp_path / "kept_elsewhere"))
        os.rename(mine, target)
        return found

    def second_look_after_another_took_the_name(path):
        if staging.is_removal_aside(path):
            users_dir(target)
        return real_is_ours(path)

    monkeypatch.setattr(local_store, "removable", removable_then_swap)
    monkeypatch.setattr(local_store, "is_checkpoint_dir", second_look_after_another_took_the_name)
    with pytest.raises(ArgumentError, match=r"left as it is at (\S+)$") as err:
        open_store(target).remove()
    aside = str(err.value).rsplit(" at ", 1)[1]
    assert staging.is_removal_aside(aside) and tree_digest(aside) == kept and tree_digest(target) == kept


def test_a_removal_stopped_after_its_rename_leaves_a_leftover_not_a_checkpoint(tmp_path, monkeypatch):
    """Interrupted (Ctrl-C) between the rename aside and the marker's removal, a committed checkpoint sits at the
    removal's aside name: no load, ``inspect``, Lightning folder scan or recovery renames it back to the removed
    name nor names it as a stranded copy, ``clean`` lists it as a removal's leftover and removes it, and the
    checkpoint beside it stays."""
    target = save_ours(tmp_path / "step=1")
    other = save_ours(tmp_path / "step=2")
    real_is_ours = local_store.is_checkpoint_dir

    def interrupted_at_the_second_look(path):
        if staging.is_removal_aside(path):
            raise KeyboardInterrupt
        return real_is_ours(path)

    monkeypatch.setattr(local_store, "is_checkpoint_dir", interrupted_at_the_second_look)
    with pytest.raises(KeyboardInterrupt):
        DistCheckpointIO().remove_checkpoint(target)
    monkeypatch.undo()
    (aside,) = [os.path.join(tmp_path, n) for n in os.listdir(tmp_path) if staging.is_staging_dir(n)]
    assert staging.is_removal_aside(aside) and is_committed(aside) and not os.path.lexists(target)

    with pytest.raises(CheckpointNotFoundError) as err:
        ldc.load_tensors_metadata(target)
    assert os.path.basename(aside) not in str(err.value) and not os.path.lexists(target)
    assert recover_interrupted_commit(target) is None and not os.path.lexists(target)
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        assert main(["inspect", target]) != 0
    assert os.path.basename(aside) not in out.getvalue() and not os.path.lexists(target)

    (found,) = staging.find_leftovers(str(tmp_path))
    assert found.path == aside and not found.committed and not found.recoverable and found.verdict(0) == "remove"
    assert found.reason("remove", 0).startswith("left by an interrupted removal of step=1")
    assert found.verdict(3600) == "recent"  # a removal's leftover ages like any uncommitted one
    done = clean(str(tmp_path), 0, dry_run=False)
    assert [(a.leftover.path, a.action) for a in done] == [(aside, "removed")]
    assert os.listdir(tmp_path) == ["step=2"] and loads(other)


def test_our_checkpoint_and_a_stock_empty_directory_are_still_removed(tmp_path):
    """No swap: a checkpoint of ours and an empty directory are removed, leaving nothing aside."""
    target = save_ours(tmp_path / "step=1")
    (tmp_path / "empty").mkdir()
    assert open_store(target).remove() and open_store(str(tmp_path / "empty")).remove()
    assert os.listdir(tmp_path) == []
