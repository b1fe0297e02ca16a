"""A parameter the optimizer kept no state for when the checkpoint was saved (no gradient yet: a
layer the model starts using later) resumes without state, as stock Lightning resumes it
(``optimizer.load_state_dict`` of the saved dict): its first step after the resume is the first
step from nothing. For SGD with dampening (and NAdam, Rprop, ASGD) a step from zero state differs,
so a zero state put in its place changes the training. Checked for a stock ``.ckpt`` file and for
the plugin's own directory, resumed by the plugin and by the strategy, against stock's resume."""

from __future__ import annotations

from typing import Any, Dict

import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.strategies import DDPStrategy

from lightning_distckpt.lightning import DistCheckpointIO, DistCheckpointStrategy
from lightning_helpers import quiet_trainer


class LateLayer(BoringModel):
    """A second layer that gets a gradient only from step 3 on: at a save after step 2 the optimizer
    has no state for it."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(32, 2)
        self.late = torch.nn.Linear(32, 2)

    def training_step(self, batch: Any, batch_idx: int) -> Dict[str, torch.Tensor]:
        out = self.layer(batch)
        if self.global_step >= 2:
            out = out + self.late(batch)
        return {"loss": out.sum()}

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9, dampening=0.5)


def _args(how: str) -> Dict[str, Any]:
    if how == "plugin":
        return {"plugins": [DistCheckpointIO()]}
    if how == "stock_ddp":  # the strategy's stock counterpart: DDP's sampler shuffles, as it does under ours
        return {"strategy": DDPStrategy()}
    return {"strategy": DistCheckpointStrategy()} if how == "strategy" else {}


def _resumed(ckpt: str, how: str) -> Dict[str, torch.Tensor]:
    torch.manual_seed(1)
    model = LateLayer()
    trainer = quiet_trainer(max_steps=4, limit_val_batches=0, enable_checkpointing=False, **_args(how))
    trainer.fit(model, ckpt_path=ckpt)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture
def saved(tmp_path, isolated_process_group) -> Dict[str, str]:
    """The state after 2 steps (no state for the late layer), as a stock ``.ckpt`` and as the plugin's directory."""
    torch.manual_seed(1)
    trainer = quiet_trainer(max_steps=2, limit_val_batches=0, enable_checkpointing=False)
    trainer.fit(LateLayer())
    out = {"stock": str(tmp_path / "stock.ckpt"), "plugin": str(tmp_path / "plugin.ckpt")}
    trainer.save_checkpoint(out["stock"])
    DistCheckpointIO().save_checkpoint(trainer._checkpoint_connector.dump_checkpoint(), out["plugin"])
    assert set(torch.load(out["stock"])["optimizer_states"][0]["state"]) == {0, 1}  # none for late.*
    return out


@pytest.mark.parametrize("file, how, stock", [("stock", "plugin", "stock"), ("plugin", "plugin", "stock"),
                                              ("stock", "strategy", "stock_ddp")])
def test_a_parameter_without_state_resumes_without_state(saved, file, how, stock):
    reference = _resumed(saved["stock"], stock)
    assert not torch.equal(reference["late.weight"], LateLayer().late.weight)  # the late layer did train
    got = _resumed(saved[file], how)
    for key, value in reference.items():
        assert torch.equal(got[key], value), key
