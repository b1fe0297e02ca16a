"""A resume under ``DistCheckpointStrategy`` restores each part where stock Lightning does, and says
what stock Lightning says: callbacks before ``on_fit_start`` (a resumed ``Timer`` whose budget is
spent trains no step), a weights-only checkpoint refused in Lightning's words, a checkpoint with
``optimizer_states={}`` restoring no optimizer state. Each case runs side by side with stock."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint, Timer

from lightning_distckpt.core.errors import CheckpointingError
from lightning_distckpt.lightning import DistCheckpointIO, DistCheckpointStrategy
from lightning_helpers import SGDMLP, TPMLP, quiet_trainer

STOCK_WORDS = ("Trying to restore optimizer state but checkpoint contains only the model. This is probably due to "
               "`ModelCheckpoint.save_weights_only` being set to `True`.")


def strategy_of(how: str):
    return DistCheckpointStrategy() if how == "strategy" else "auto"


@pytest.mark.parametrize("how", ["stock", "strategy"])
def test_a_spent_timer_stops_before_the_first_step(tmp_path, isolated_process_group, how):
    """The Timer checks its budget in on_fit_start: its elapsed time must be back by then."""
    first = quiet_trainer(strategy=strategy_of(how), max_steps=2, callbacks=[Timer(duration=timedelta(days=1))],
                          enable_checkpointing=False)
    first.fit(TPMLP(total_steps=2))
    path = tmp_path / "two_steps.ckpt"
    first.save_checkpoint(path)
    timer = Timer(duration=timedelta(microseconds=1))  # less than the 2 steps the checkpoint spent
    model = TPMLP(total_steps=10)
    trainer = quiet_trainer(strategy=strategy_of(how), max_steps=10, callbacks=[timer], enable_checkpointing=False)
    trainer.fit(model, ckpt_path=path)
    assert timer._offset > 0  # the saved elapsed time was restored
    assert trainer.global_step == 2 and model.losses == {}  # stopped at on_fit_start: no step trained


def test_weights_only_checkpoints_are_refused_in_lightnings_words(tmp_path, isolated_process_group):
    stock = quiet_trainer(max_steps=2, enable_checkpointing=False)
    stock.fit(SGDMLP(total_steps=2))
    stock.save_checkpoint(tmp_path / "stock.ckpt", weights_only=True)
    plugin_ckpt = ModelCheckpoint(dirpath=tmp_path / "plugin", save_weights_only=True)
    quiet_trainer(max_steps=2, plugins=[DistCheckpointIO()], callbacks=[plugin_ckpt]).fit(SGDMLP(total_steps=2))
    ours = quiet_trainer(strategy=DistCheckpointStrategy(), max_steps=2, enable_checkpointing=False)
    ours.fit(SGDMLP(total_steps=2))
    ours.save_checkpoint(tmp_path / "ours.ckpt", weights_only=True)

    with pytest.raises(KeyError) as stock_error:  # stock Lightning, its own file
        quiet_trainer(max_steps=4, enable_checkpointing=False).fit(SGDMLP(total_steps=4),
                                                                   ckpt_path=tmp_path / "stock.ckpt")
    with pytest.raises(KeyError) as plugin_error:  # the plugin's directory, read by stock Lightning
        quiet_trainer(max_steps=4, plugins=[DistCheckpointIO()], enable_checkpointing=False).fit(
            SGDMLP(total_steps=4), ckpt_path=plugin_ckpt.best_model_path)
    assert stock_error.value.args[0] == plugin_error.value.args[0] == STOCK_WORDS
    for path in (tmp_path / "stock.ckpt", tmp_path / "ours.ckpt"):  # the strategy: the same words, and the path
        with pytest.raises(CheckpointingError) as ours_error:
            quiet_trainer(strategy=DistCheckpointStrategy(), max_steps=4, enable_checkpointing=False).fit(
                SGDMLP(total_steps=4), ckpt_path=path)
        assert isinstance(ours_error.value, KeyError) and str(ours_error.value).startswith(STOCK_WORDS)
        assert str(path) in str(ours_error.value)


@pytest.mark.parametrize("how", ["stock", "strategy"])
def test_an_empty_optimizer_states_entry_restores_nothing(tmp_path, isolated_process_group, how):
    """A hand-made ``.ckpt`` whose ``optimizer_states`` is ``{}``: the weights and loops are restored,
    the optimizer starts afresh (stock zips the states with the optimizers)."""
    first = quiet_trainer(max_steps=2, enable_checkpointing=False)
    saved = TPMLP(total_steps=2)
    first.fit(saved)
    path = tmp_path / "hand.ckpt"
    first.save_checkpoint(path)
    checkpoint = torch.load(path, weights_only=False)
    checkpoint["optimizer_states"] = {}
    torch.save(checkpoint, path)
    model = TPMLP(total_steps=3)
    trainer = quiet_trainer(strategy=strategy_of(how), max_steps=3, enable_checkpointing=False)
    trainer.fit(model, ckpt_path=path)
    assert sorted(model.losses) == [2]
    opt = trainer.optimizers[0]
    assert float(opt.state[model.fc1.weight]["step"]) == 1.0  # one step of a fresh AdamW, not 3
