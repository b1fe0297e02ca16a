"""Background saves (``async_save: true``) behave as Lightning's synchronous ones where Lightning
looks: a name in flight counts as taken when ``ModelCheckpoint`` picks ``-vN`` names, and every save
the library accepted ends committed (a save after ``fit()``, the spawn launcher's last weights, a
process that exits with a save in flight)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from lightning.pytorch.callbacks import ModelCheckpoint

import lightning_distckpt as ldc
from lightning_distckpt.lightning import DistCheckpointIO, DistCheckpointStrategy
from lightning_distckpt.storage.layout import is_committed
from lightning_helpers import TPMLP, quiet_trainer

ASYNC = {"async_save": True}


def async_setup(how: str, **kwargs):
    """A Trainer saving in the background: the plugin under a stock strategy, or our strategy."""
    if how == "plugin":
        return quiet_trainer(plugins=[DistCheckpointIO(ASYNC)], **kwargs)
    return quiet_trainer(strategy=DistCheckpointStrategy(checkpoint=ASYNC), **kwargs)


@pytest.mark.parametrize("how", ["plugin", "strategy"])
def test_a_name_in_flight_is_taken(tmp_path, isolated_process_group, how):
    """One name for every epoch (``filename="test"``): ModelCheckpoint versions it because the previous
    save, still in flight, already holds the name."""
    ck = ModelCheckpoint(dirpath=tmp_path, filename="test", save_top_k=-1, monitor="epoch", mode="max")
    trainer = async_setup(how, max_epochs=4, limit_train_batches=1, callbacks=[ck])
    trainer.fit(TPMLP(total_steps=4))
    expected = {"test.ckpt", "test-v1.ckpt", "test-v2.ckpt", "test-v3.ckpt"}
    assert set(os.listdir(tmp_path)) == expected  # all four kept, no staging directory left
    assert {os.path.basename(p) for p in ck.best_k_models} == expected
    epochs = {ldc.load_common_state_dict(tmp_path / name)["epoch"] for name in expected}
    assert epochs == {0, 1, 2, 3}  # four checkpoints, none replaced by the next


def test_a_save_after_fit_is_committed_before_it_is_read(tmp_path, isolated_process_group):
    """The plugin under a stock strategy: a save after ``fit()`` is still in flight (nothing later in
    the run commits it); a new Trainer with its own plugin, in the same process, resumes from it."""
    trainer = async_setup("plugin", max_steps=2, enable_checkpointing=False)
    trainer.fit(TPMLP(total_steps=2))
    path = tmp_path / "after.ckpt"
    trainer.save_checkpoint(path)
    assert trainer.strategy.checkpoint_io.pending is not None and os.listdir(path) == []  # held while in flight
    model = TPMLP(total_steps=3)
    quiet_trainer(max_steps=3, plugins=[DistCheckpointIO()], enable_checkpointing=False).fit(model, ckpt_path=path)
    assert sorted(model.losses) == [2] and is_committed(path)


def test_the_strategy_commits_a_save_after_fit_before_returning(tmp_path, isolated_process_group):
    trainer = async_setup("strategy", max_steps=2, enable_checkpointing=False)
    trainer.fit(TPMLP(total_steps=2))
    trainer.save_checkpoint(tmp_path / "after.ckpt")  # every rank; nothing later in the run would commit it
    assert trainer.strategy.checkpoint_io.pending is None and is_committed(tmp_path / "after.ckpt")


def test_a_save_in_flight_at_exit_is_committed(tmp_path):
    """The plugin's own save (what a stock strategy calls on rank 0) in a process that then ends."""
    path = tmp_path / "ck"
    script = ("import torch; from lightning_distckpt.lightning import DistCheckpointIO; "
              f"DistCheckpointIO({ASYNC!r}).save_checkpoint({{'state_dict': {{'w': torch.ones(3)}}}}, {str(path)!r})")
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
    assert is_committed(path) and ldc.load_plain_tensors(path)["state_dict/w"].tolist() == [1.0, 1.0, 1.0]
    assert sorted(os.listdir(tmp_path)) == ["ck"]


@pytest.mark.parametrize("how", ["plugin", "strategy"])
def test_spawn_fit_ends_with_the_workers_saves_committed(tmp_path, isolated_process_group, how):
    """The spawn launcher: the worker saves its last weights with the plugin after teardown and the
    main process loads them once the worker has exited (stock ``ddp_spawn`` + the plugin, or the
    strategy started by spawn)."""
    ck = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=-1)
    if how == "plugin":
        trainer = quiet_trainer(strategy="ddp_spawn", plugins=[DistCheckpointIO(ASYNC)], max_steps=2, callbacks=[ck])
    else:
        strategy = DistCheckpointStrategy(checkpoint=ASYNC, start_method="spawn")
        trainer = quiet_trainer(strategy=strategy, max_steps=2, callbacks=[ck])
    trainer.fit(TPMLP(total_steps=2))  # the main process loaded the worker's last weights
    assert trainer.state.finished
    assert sorted(os.listdir(tmp_path)) == ["epoch=0-step=1.ckpt", "epoch=0-step=2.ckpt"]
    assert all(is_committed(tmp_path / name) for name in os.listdir(tmp_path))
