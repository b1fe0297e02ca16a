"""A Trainer under ``DistCheckpointStrategy``, or with the plugin saving in the background, can be
copied and pickled as a stock one can: ``deepcopy`` of callbacks that hold the trainer (as progress
bars do) during ``fit``, ``torch.save(trainer)`` after it. Process groups, threads and locks stay
with the original; a copy finds the live process groups again."""

from __future__ import annotations

import copy
import os

import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader

from lightning_distckpt.lightning import DistCheckpointIO, DistCheckpointStrategy
from lightning_distckpt.storage.layout import is_committed
from lightning_helpers import TPMLP, quiet_trainer


class LoaderMLP(TPMLP):
    """TPMLP fed by a DataLoader, as stock models are (its own batches come from a generator, which no
    Trainer holding it could copy, stock or not)."""

    def train_dataloader(self) -> DataLoader:
        return DataLoader(list(super().train_dataloader()), batch_size=None)


class HoldsTrainer(Callback):
    """Keeps the trainer, as Lightning's progress bars do, and copies the callbacks once training starts."""

    def __init__(self) -> None:
        self.trainer = None
        self.copied = None

    def setup(self, trainer, pl_module, stage):
        self.trainer = trainer

    def on_train_start(self, trainer, pl_module):
        self.copied = copy.deepcopy(trainer.callbacks)


def test_strategy_trainer_copies_and_pickles(tmp_path, isolated_process_group):
    holder = HoldsTrainer()
    trainer = quiet_trainer(strategy=DistCheckpointStrategy(), max_steps=2, callbacks=[holder],
                            enable_checkpointing=False)
    trainer.fit(LoaderMLP(total_steps=2))
    assert holder.copied is not None and len(holder.copied) == len(trainer.callbacks)
    torch.save(trainer, tmp_path / "trainer.pt")
    restored = torch.load(tmp_path / "trainer.pt", weights_only=False)
    ps, again = trainer.strategy.parallel_state, restored.strategy.parallel_state
    assert (again.tp_size, again.dp_size, again.rank) == (ps.tp_size, ps.dp_size, ps.rank)
    assert again.dp_group is ps.dp_group and again.tp_group is ps.tp_group  # still alive in this process
    assert restored.lightning_module.ps.dp_group is ps.dp_group  # the module's own copy too
    assert copy.deepcopy(ps) is ps


def test_plugin_with_a_save_in_flight_copies_and_pickles(tmp_path, isolated_process_group):
    trainer = quiet_trainer(plugins=[DistCheckpointIO({"async_save": True})], max_steps=2, callbacks=[HoldsTrainer()],
                            enable_checkpointing=False)
    trainer.fit(LoaderMLP(total_steps=2))
    trainer.save_checkpoint(tmp_path / "in_flight.ckpt")
    io = trainer.strategy.checkpoint_io
    assert io.pending is not None
    torch.save(trainer, tmp_path / "trainer.pt")
    twin = copy.deepcopy(io)
    restored = torch.load(tmp_path / "trainer.pt", weights_only=False)
    for other in (twin, restored.strategy.checkpoint_io):  # the settings travel, the save in flight does not
        assert other.config.async_save and other.pending is None
    io.wait()  # the original still commits its save
    assert is_committed(tmp_path / "in_flight.ckpt")
    assert sorted(os.listdir(tmp_path)) == ["in_flight.ckpt", "trainer.pt"]
