"""A fit stopped mid-epoch at a checkpoint and resumed with ``ckpt_path=`` follows stock Lightning's
trajectory exactly, under ``Trainer(strategy="ddp", plugins=[DistCheckpointIO()])`` and under
``DistCheckpointStrategy``, on 2 gloo processes (CPU): the same losses after the resume, final
weights (buffers too), optimizer and LR scheduler states, loop counters and callback states, bit for
bit. Each scenario covers several features at once:

* ``automatic``: ``accumulate_grad_batches=3`` with the checkpoint between accumulation boundaries,
  ``gradient_clip_val``, a step-interval scheduler with ``frequency=2`` and an epoch-interval
  ``ReduceLROnPlateau`` on ``val_loss`` (two schedulers), ``val_check_interval=0.5`` with the checkpoint
  between val runs, ``EarlyStopping``, two ``ModelCheckpoint`` (two states keyed by their
  ``state_key``), ``LearningRateMonitor``;
* ``manual``: a GAN-style module with two optimizers (manual optimization, ``toggle_optimizer``),
  a manually stepped scheduler, ``check_val_every_n_epoch=2``, ``precision="bf16-mixed"``, a
  non-persistent buffer and a ``torch.Generator`` whose state ``on_save_checkpoint`` adds;
* ``swa`` / ``ema`` (long): Lightning's ``StochasticWeightAveraging`` and ``EMAWeightAveraging``.
"""

from __future__ import annotations

import os
from typing import Any, Dict, List

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch import callbacks as pl_callbacks
from lightning.pytorch.callbacks import EarlyStopping, LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.strategies import DDPStrategy
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from dist_utils import free_port, run_distributed
from lightning_helpers import state_differences
from lightning_distckpt.lightning import DistCheckpointIO, DistCheckpointStrategy

HOWS = ("stock", "plugin", "strategy")
SAMPLES, BATCH = 64, 4  # 8 batches an epoch on each of 2 ranks


def _data(seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(SAMPLES, 8, generator=g), torch.randn(SAMPLES, 2, generator=g))


class Recorder(LightningModule):
    """What the modules share: seeded data, a record of the losses of each training batch."""

    def __init__(self) -> None:
        super().__init__()
        self.losses: List[torch.Tensor] = []

    def train_dataloader(self) -> DataLoader:
        return DataLoader(_data(1), batch_size=BATCH, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(_data(2), batch_size=BATCH)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.mse_loss(self(x).float(), y), sync_dist=True)


class Automatic(Recorder):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.losses.append(loss.detach().clone())
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        step = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=0, threshold=0.5)
        return [opt], [{"scheduler": step, "interval": "step", "frequency": 2},
                       {"scheduler": plateau, "interval": "epoch", "monitor": "val_loss"}]


class OneScheduler(Automatic):
    """SWA takes one scheduler at most."""

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)]


class GAN(Recorder):
    """Two optimizers stepped by hand; a noise generator and a non-persistent buffer as part of the state."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        torch.manual_seed(0)
        self.gen, self.disc = torch.nn.Linear(8, 2), torch.nn.Linear(2, 1)
        self.register_buffer("seen", torch.zeros(()), persistent=False)  # not saved: restarts at 0, as stock
        self.register_buffer("mean_y", torch.zeros(2))
        self.noise = torch.Generator().manual_seed(5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gen(x)

    def training_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        opt_g, opt_d = self.optimizers()
        x = x + 0.1 * torch.randn(x.shape, generator=self.noise)
        self.seen += 1
        self.mean_y.mul_(0.9).add_(0.1 * y.mean(0))
        self.toggle_optimizer(opt_g)
        loss_g = -self.disc(self(x)).mean() + F.mse_loss(self(x).float(), y)
        self.manual_backward(loss_g)
        opt_g.step()
        opt_g.zero_grad()
        self.untoggle_optimizer(opt_g)
        self.toggle_optimizer(opt_d)
        loss_d = self.disc(self(x).detach()).mean() - self.disc(y).mean()
        self.manual_backward(loss_d)
        opt_d.step()
        opt_d.zero_grad()
        self.untoggle_optimizer(opt_d)
        self.lr_schedulers().step()
        self.losses.append(torch.stack([loss_g.detach(), loss_d.detach()]).float())

    def configure_optimizers(self) -> Any:
        opt_g = torch.optim.Adam(self.gen.parameters(), lr=0.01)
        opt_d = torch.optim.SGD(self.disc.parameters(), lr=0.01, momentum=0.5)
        return [opt_g, opt_d], [torch.optim.lr_scheduler.StepLR(opt_g, step_size=3, gamma=0.5)]

    def on_save_checkpoint(self, checkpoint: Dict[str, Any]) -> None:
        checkpoint["noise_state"] = self.noise.get_state()
        checkpoint["note"] = {"saved_at": self.global_step}

    def on_load_checkpoint(self, checkpoint: Dict[str, Any]) -> None:
        self.noise.set_state(checkpoint["noise_state"])


class StopAt(Callback):
    """Saves at (epoch, batch) and stops there: the interruption."""

    def __init__(self, epoch: int, batch: int, path: str) -> None:
        self.epoch, self.batch, self.path = epoch, batch, path

    def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
        if trainer.current_epoch == self.epoch and args[-1] == self.batch:
            trainer.save_checkpoint(self.path)
            trainer.should_stop = True


def _callbacks(scenario: str, root: str) -> List[Callback]:
    if scenario == "automatic":
        return [EarlyStopping(monitor="val_loss", patience=50, min_delta=0.0),
                ModelCheckpoint(dirpath=os.path.join(root, "best"), monitor="val_loss", save_top_k=2),
                ModelCheckpoint(dirpath=os.path.join(root, "steps"), every_n_train_steps=2, save_top_k=-1),
                LearningRateMonitor(logging_interval="step")]
    if scenario == "swa":
        return [pl_callbacks.StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=1)]
    if scenario == "ema":
        return [pl_callbacks.EMAWeightAveraging(decay=0.7)]
    return [ModelCheckpoint(dirpath=os.path.join(root, "last"), save_last=True, save_top_k=0)]


SCENARIOS = {  # module, Trainer settings, where the run is interrupted (epoch, batch index)
    "automatic": (Automatic, dict(max_epochs=3, accumulate_grad_batches=3, gradient_clip_val=0.5,
                                  val_check_interval=0.5), (1, 4)),
    "manual": (GAN, dict(max_epochs=4, check_val_every_n_epoch=2, precision="bf16-mixed"), (2, 3)),
    "swa": (OneScheduler, dict(max_epochs=3), (1, 5)),
    "ema": (OneScheduler, dict(max_epochs=3), (1, 5)),
}


def _trainer(how: str, scenario: str, root: str, extra: List[Callback]) -> Trainer:
    args = dict(SCENARIOS[scenario][1])
    ddp = {"find_unused_parameters": scenario == "manual"}  # each optimizer's step uses part of the module
    if how == "strategy":
        args["strategy"] = DistCheckpointStrategy(**ddp)
    else:
        args.update(strategy=DDPStrategy(**ddp), plugins=[DistCheckpointIO()] if how == "plugin" else [])
    return Trainer(accelerator="cpu", devices=2, logger=CSVLogger(root, name="logs"), enable_progress_bar=False,
                   enable_model_summary=False, callbacks=_callbacks(scenario, root) + extra, **args)


def _plain(value: Any, root: str) -> Any:
    """A state with this run's directory replaced by ROOT and tensors copied (comparable across runs)."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {_plain(k, root): _plain(v, root) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v, root) for v in value)
    return value.replace(root, "ROOT") if isinstance(value, str) else value


def _state(trainer: Trainer, model: Recorder, root: str) -> Dict[str, Any]:
    return _plain({
        "losses": model.losses, "weights": dict(model.state_dict()), "buffers": dict(model.named_buffers()),
        "optimizers": [opt.state_dict() for opt in trainer.optimizers],
        "schedulers": [cfg.scheduler.state_dict() for cfg in trainer.lr_scheduler_configs],
        "loops": trainer.fit_loop.state_dict(), "counters": [trainer.global_step, trainer.current_epoch],
        "callbacks": {cb.state_key: cb.state_dict() for cb in trainer.callbacks},
        "precision": trainer.precision_plugin.state_dict(),
        "noise": model.noise.get_state() if isinstance(model, GAN) else None,
    }, root)


def _fits(rank: int, world: int, base: str, scenario: str, port: int) -> Dict[str, Any]:
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))  # Lightning joins the group run_distributed made
    module, _, (epoch, batch) = SCENARIOS[scenario]
    out = {}
    for how in HOWS:
        root = os.path.join(base, how)
        path = os.path.join(root, "interrupted.ckpt")
        _trainer(how, scenario, root, [StopAt(epoch, batch, path)]).fit(module())
        model, trainer = module(), _trainer(how, scenario, root, [])
        trainer.fit(model, ckpt_path=path)
        out[how] = _state(trainer, model, root)
    return out


def _check(tmp_path, scenario: str) -> None:
    for rank, runs in enumerate(run_distributed(_fits, 2, str(tmp_path), scenario, free_port(), timeout_s=120)):
        stock = runs["stock"]
        assert len(stock["losses"]) > 3, stock["losses"]  # the resumed fit did train
        for how in HOWS[1:]:
            diff = state_differences(runs[how], stock)
            assert not diff, f"rank {rank}, {how} vs stock:\n" + "\n".join(diff[:20])


@pytest.mark.parametrize("scenario", ["manual", "automatic"])
def test_a_resumed_fit_follows_stocks_trajectory(tmp_path, scenario):
    _check(tmp_path, scenario)


@pytest.mark.long
@pytest.mark.parametrize("scenario", ["swa", "ema"])
def test_a_resumed_weight_averaging_fit_follows_stocks_trajectory(tmp_path, scenario):
    _check(tmp_path, scenario)
