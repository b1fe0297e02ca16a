"""What Lightning's own checkpointing tests check (``tests/tests_pytorch/checkpointing``, run against
us by ``tools/peer_suites/lightning``), asserted here on our checkpoints read through our loader:
each case runs stock, with ``DistCheckpointIO`` and with ``DistCheckpointStrategy`` (one process,
CPU), and the checkpoints' contents must be the ones stock Lightning writes.

* ``ModelCheckpoint``'s files: names, top-k removal, ``last``, and the paths and step counters the
  checkpoint itself records;
* a checkpoint saved before any fit (the callback called on a Trainer whose strategy only has the
  module connected): under ``DistCheckpointStrategy`` too, one process, committed on return even
  with ``async_save``, and resumable;
* ``OnExceptionCheckpoint``'s checkpoint when training raises;
* Lightning's ``AsyncCheckpointIO`` wrapping ours: the same files and contents (every checkpoint
  kept: its ``remove_checkpoint`` does not wait for the saves queued before it, for any base plugin,
  so a top-k removal can come before the save it removes; our ``async_save`` defers removals).
"""

from __future__ import annotations

import os
from typing import Any, Dict

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.plugins.io import AsyncCheckpointIO

from lightning_distckpt.lightning import DistCheckpointIO, DistCheckpointStrategy
from lightning_helpers import quiet_trainer

HOWS = ["stock", "plugin", "strategy"]


def trainer_args(how: str) -> Dict[str, Any]:
    """What a Trainer gets to save stock, with the plugin or with the strategy."""
    if how == "plugin":
        return {"plugins": [DistCheckpointIO()]}
    if how == "async":
        return {"plugins": [DistCheckpointIO({"async_save": True})]}
    if how == "lightning_async":
        return {"plugins": [AsyncCheckpointIO(DistCheckpointIO())]}
    if how == "strategy_async":
        return {"strategy": DistCheckpointStrategy(checkpoint={"async_save": True})}
    return {"strategy": DistCheckpointStrategy()} if how == "strategy" else {}


def read(path: Any) -> Dict[str, Any]:
    """A checkpoint read whole: stock's file or our directory (the loader takes both)."""
    return DistCheckpointIO().load_checkpoint(path)


class Loud(BoringModel):
    """BoringModel logging its step as ``step_metric`` (a monitor that grows every step)."""

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        out = super().training_step(batch, batch_idx)
        self.log("step_metric", float(self.global_step))
        return out


@pytest.mark.parametrize("how", HOWS + ["async"])
def test_top_k_and_last_files_and_what_they_record(tmp_path, isolated_process_group, how):
    mc = ModelCheckpoint(dirpath=tmp_path, monitor="step_metric", mode="max", save_top_k=2, save_last=True,
                         every_n_train_steps=1, filename="{step}")
    trainer = quiet_trainer(max_steps=4, limit_val_batches=0, callbacks=[mc], **trainer_args(how))
    trainer.fit(Loud())
    assert sorted(os.listdir(tmp_path)) == ["last.ckpt", "step=3.ckpt", "step=4.ckpt"]  # top 2 of 4, and last
    assert mc.best_model_path == str(tmp_path / "step=4.ckpt")
    best, last = read(mc.best_model_path), read(mc.last_model_path)
    assert best["global_step"] == last["global_step"] == 4
    state = last["callbacks"][mc.state_key]
    assert state["last_model_path"] == str(tmp_path / "last.ckpt")
    assert state["best_model_path"] == str(tmp_path / "step=4.ckpt")  # as recorded when last.ckpt was written
    assert set(state["best_k_models"]) == {str(tmp_path / "step=3.ckpt"), str(tmp_path / "step=4.ckpt")}


@pytest.mark.parametrize("how", HOWS + ["strategy_async"])
def test_a_checkpoint_saved_before_any_fit_records_its_path_and_resumes(tmp_path, isolated_process_group, how):
    mc = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    mc.CHECKPOINT_NAME_LAST = "{epoch}-last"
    trainer = quiet_trainer(callbacks=[mc], **trainer_args(how))
    model = BoringModel()
    trainer.strategy.connect(model)  # the module attached, no fit: no process group was set up
    mc._save_last_checkpoint(trainer, {})
    path = tmp_path / "epoch=0-last.ckpt"
    assert os.listdir(tmp_path) == [path.name]  # committed on return (async too: no later hook would)
    saved = read(path)
    assert saved["callbacks"][mc.state_key]["last_model_path"] == str(path)
    assert torch.equal(saved["state_dict"]["layer.weight"], model.layer.weight)
    again = BoringModel()
    resumed = quiet_trainer(max_steps=1, limit_val_batches=0, enable_checkpointing=False, **trainer_args(how))
    resumed.fit(again, ckpt_path=path)
    assert resumed.global_step == 1


class Fails(BoringModel):
    def training_step(self, batch: Any, batch_idx: int) -> Any:
        if self.global_step == 2:
            raise RuntimeError("trouble at step 2")
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("how", HOWS)
def test_on_exception_checkpoint_holds_the_step_reached(tmp_path, isolated_process_group, how):
    trainer = quiet_trainer(max_steps=5, limit_val_batches=0, default_root_dir=tmp_path / "root",
                            callbacks=[OnExceptionCheckpoint(tmp_path, filename="crash")], **trainer_args(how))
    model = Fails()
    with pytest.raises(RuntimeError, match="trouble at step 2"):
        trainer.fit(model)
    saved = read(tmp_path / "crash.ckpt")
    assert saved["global_step"] == 2
    assert torch.equal(saved["state_dict"]["layer.weight"], model.layer.weight)


def test_lightnings_async_wrapper_around_ours_writes_every_checkpoint(tmp_path, isolated_process_group):
    mc = ModelCheckpoint(dirpath=tmp_path, save_top_k=-1, every_n_train_steps=1, filename="{step}")
    model = BoringModel()
    trainer = quiet_trainer(max_steps=3, limit_val_batches=0, callbacks=[mc], **trainer_args("lightning_async"))
    trainer.fit(model)  # its teardown waits for the queued saves
    assert sorted(os.listdir(tmp_path)) == ["step=1.ckpt", "step=2.ckpt", "step=3.ckpt"]
    assert [read(tmp_path / f"step={i}.ckpt")["global_step"] for i in (1, 2, 3)] == [1, 2, 3]
    assert torch.equal(read(tmp_path / "step=3.ckpt")["state_dict"]["layer.weight"], model.layer.weight)
