"""Removal and relinking remove only stock Lightning checkpoint files, never a user's ``torch.save`` file.

``ModelCheckpoint``'s top-k rotation (``DistCheckpointIO.remove_checkpoint`` -> ``LocalStore.remove``) and
``link_last`` (``save_last="link"``) took any ``torch.save`` archive at a tracked name for a checkpoint and
deleted it: ``torch.save(model.state_dict(), "ckpts/step=1.ckpt")``, ``fabric.save``'s file, a data set's
tensors. Now, as a save's target check has it, only a file that Lightning's ``TorchCheckpointIO`` wrote (its
pickle holds ``pytorch-lightning_version``) or an empty file (a torn stock save) is removed; anything else is an
``ArgumentError`` naming the path and what is there, and stays, byte for byte. Real Trainer and Fabric runs,
real files; the removal's and the relinking's second looks are reached by changing the name right after the
first look, as another process would."""

from __future__ import annotations

import hashlib
import os

import pytest
import torch

from lightning_distckpt.core.errors import ArgumentError
from lightning_distckpt.lightning import DistCheckpointIO
from lightning_distckpt.lightning import last_link
from lightning_distckpt.storage import local_store
from lightning_distckpt.storage.stores import open_store
from lightning_distckpt.storage.swap import NO_EXCHANGE_ENV

USERS = "a torch.save file, not a Trainer's"


def sha(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def users_state_dict(path) -> str:
    torch.save(torch.nn.Linear(3, 2).state_dict(), path)
    return str(path)


def users_tensors(path) -> str:
    torch.save(torch.arange(12.0).reshape(3, 4), path)  # a data set's tensors
    return str(path)


def fabric_saved(path) -> str:
    """What ``fabric.save`` writes under stock Fabric: a torch.save file without Lightning's key."""
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=1)
    fabric.save(str(path), {"model": torch.nn.Linear(3, 2), "step": 4})
    return str(path)


def stock_lightning(path) -> str:
    """A real Trainer's checkpoint, written by stock ``TorchCheckpointIO``."""
    from lightning.pytorch import Trainer
    from lightning.pytorch.demos.boring_classes import BoringModel

    trainer = Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(BoringModel())
    trainer.save_checkpoint(str(path))
    return str(path)


def empty(path) -> str:
    open(path, "wb").close()
    return str(path)


USER_FILES = {"state_dict": users_state_dict, "tensors": users_tensors, "fabric_save": fabric_saved}


@pytest.mark.parametrize("kind", sorted(USER_FILES))
def test_a_users_torch_file_is_refused_and_intact(tmp_path, kind):
    """remove_checkpoint (ModelCheckpoint's top-k), the store's remove and link_last refuse a user's torch.save
    file, naming the path and what it is; its bytes stay, nothing is left aside."""
    path = USER_FILES[kind](tmp_path / "epoch=0-step=10.ckpt")
    before = sha(path)
    for remove in (DistCheckpointIO().remove_checkpoint, lambda p: open_store(p).remove()):
        with pytest.raises(ArgumentError, match="not a checkpoint of ours") as e:
            remove(path)
        assert path in str(e.value) and USERS in str(e.value)
    with pytest.raises(ArgumentError, match="is not a checkpoint") as e:
        last_link.link_last(str(tmp_path / "elsewhere"), path)
    assert path in str(e.value) and USERS in str(e.value)
    assert sha(path) == before and os.listdir(tmp_path) == [os.path.basename(path)]


def test_a_link_to_a_users_torch_file_is_kept_with_it(tmp_path):
    """A link at a tracked name to a user's torch.save file: refused (naming the file), both stay."""
    target = users_state_dict(tmp_path / "weights.pt")
    link = tmp_path / "last.ckpt"
    os.symlink(target, link)
    with pytest.raises(ArgumentError, match=f"a link to {target}, which is not a checkpoint .{USERS}"):
        DistCheckpointIO().remove_checkpoint(str(link))
    assert os.path.islink(link) and os.path.isfile(target)


@pytest.mark.parametrize("make", [stock_lightning, empty], ids=["stock_lightning", "empty"])
def test_a_stock_lightning_file_and_an_empty_file_are_still_removed_and_relinked(tmp_path, make):
    """A stock run's checkpoint file (a run moved from stock rotates past it) and a torn stock save (empty) are
    removed by remove_checkpoint and the store's remove, and replaced by link_last's link."""
    for remove in (DistCheckpointIO().remove_checkpoint, lambda p: open_store(p).remove()):
        path = make(tmp_path / "epoch=0-step=1.ckpt")
        remove(path)
        assert os.listdir(tmp_path) == []
    ours = tmp_path / "step=2"
    ours.mkdir()
    last = make(tmp_path / "last.ckpt")
    last_link.link_last(str(ours), last)
    assert os.readlink(last) == "step=2" and sorted(os.listdir(tmp_path)) == ["last.ckpt", "step=2"]


def test_the_rotation_refuses_a_users_torch_file_at_a_tracked_name(tmp_path):
    """ModelCheckpoint(save_top_k=1) under the plugin: the previous best's name now holds the user's own
    torch.save of the weights; its rotation fails the fit naming it, and the file stays. Before: deleted."""
    from lightning.pytorch import Callback, Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.demos.boring_classes import BoringModel

    folder = tmp_path / "ckpts"
    first = os.path.join(folder, "step=1.ckpt")
    before = []

    class Overwrite(Callback):
        def on_train_batch_end(self, trainer, pl_module, *args):
            if trainer.global_step == 2:  # before ModelCheckpoint's save of step 2 (and removal of step 1)
                open_store(first).remove()  # ours: removed
                torch.save(pl_module.state_dict(), first)
                before.append(sha(first))

    mc = ModelCheckpoint(dirpath=folder, filename="{step}", every_n_train_steps=1, save_top_k=1,
                         monitor="step", mode="max")
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, plugins=[DistCheckpointIO()], callbacks=[Overwrite(), mc])
    with pytest.raises(ArgumentError, match=f"step=1.ckpt: not a checkpoint of ours .*{USERS}"):
        trainer.fit(BoringModel())
    assert before and sha(first) == before[0]


def test_the_rotation_removes_a_stock_lightning_file_at_a_tracked_name(tmp_path):
    """The same fit where the name holds a stock Lightning checkpoint file (what a stock run wrote there):
    removed by the rotation, the fit finishes."""
    from lightning.pytorch import Callback, Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.demos.boring_classes import BoringModel
    from lightning.pytorch.plugins.io import TorchCheckpointIO

    folder = tmp_path / "ckpts"
    first = os.path.join(folder, "step=1.ckpt")
    written = []

    class Overwrite(Callback):
        def on_train_batch_end(self, trainer, *args):
            if trainer.global_step == 2:
                open_store(first).remove()
                TorchCheckpointIO().save_checkpoint(trainer._checkpoint_connector.dump_checkpoint(), first)
                written.append(first)

    mc = ModelCheckpoint(dirpath=folder, filename="{step}", every_n_train_steps=1, save_top_k=1,
                         monitor="step", mode="max")
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, plugins=[DistCheckpointIO()], callbacks=[Overwrite(), mc])
    trainer.fit(BoringModel())
    assert written and sorted(os.listdir(folder)) == ["step=2.ckpt"]


def test_a_users_torch_file_put_at_the_name_after_the_removal_check_is_kept(tmp_path, monkeypatch):
    """A stock Lightning file found removable, then replaced by a user's torch.save file (another process):
    the check again once renamed aside refuses it, naming what it is, and puts it back whole. Before: the
    second look took any torch.save file for a checkpoint, and deleted it."""
    target = stock_lightning(tmp_path / "epoch=0-step=2.ckpt")
    mine = users_state_dict(tmp_path / "mine.pt")
    kept = sha(mine)
    real_removable = local_store.removable

    def removable_then_replace(path):
        found = real_removable(path)
        os.replace(mine, path)
        return found

    monkeypatch.setattr(local_store, "removable", removable_then_replace)
    with pytest.raises(ArgumentError, match=f"other than a checkpoint file was put at its name .*{USERS}"):
        DistCheckpointIO().remove_checkpoint(target)
    assert sha(target) == kept and os.listdir(tmp_path) == [os.path.basename(target)]  # back, nothing aside


@pytest.mark.parametrize("exchange", [True, False], ids=["exchange", "two_renames"])
def test_a_users_torch_file_put_at_last_after_the_link_check_is_kept(tmp_path, monkeypatch, caplog, exchange):
    """link_last found a stock last.ckpt file replaceable, then a user's torch.save file took its name: the
    link goes in, and what came out is checked again and kept (logged, at its aside name), never deleted.
    Before: the rename over the name deleted it."""
    if not exchange:
        monkeypatch.setenv(NO_EXCHANGE_ENV, "1")
    ours = tmp_path / "step=2"
    ours.mkdir()
    last = stock_lightning(tmp_path / "last.ckpt")
    mine = users_state_dict(tmp_path / "mine.pt")
    kept = sha(mine)
    real_removable = last_link.removable
    calls = []

    def removable_then_replace(path):
        found = real_removable(path)
        if not calls:
            os.replace(mine, path)
        calls.append(path)
        return found

    monkeypatch.setattr(last_link, "removable", removable_then_replace)
    last_link.link_last(str(ours), last)
    assert os.readlink(last) == "step=2"
    left = [os.path.join(tmp_path, n) for n in os.listdir(tmp_path) if n not in ("last.ckpt", "step=2")]
    assert len(left) == 1 and sha(left[0]) == kept
    assert f"{left[0]}: replaced by a link, it is not a checkpoint ({USERS}" in caplog.text
