"""Trainer runs of ``DistCheckpointModelParallelStrategy`` (FSDP2 / tensor parallel on CPU gloo meshes)
for tests/lightning/test_model_parallel*.py: ``python model_parallel_scenarios.py SCENARIO... --dir D --out O``.

Every rank writes ``OUT.rank<r>.json``. Step ``s``'s global batch depends only on ``s`` (StepBatches),
so a resumed run sees the data an uninterrupted one would, under any DP x TP split.
"""

from __future__ import annotations

import argparse
import os
import sys
from datetime import timedelta
from typing import Any, Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # tests/ (lightning_helpers)

from scenario_runner import scenario_main  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from lightning.pytorch import Callback, LightningModule, Trainer  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module  # noqa: E402
from torch.nn import functional as F  # noqa: E402

from lightning_distckpt import CheckpointingError  # noqa: E402
from lightning_distckpt.lightning import (DistCheckpointIO, DistCheckpointModelParallelStrategy,  # noqa: E402
                                         DistCheckpointStrategy, export_torch_file)
from border_trainer import expected_shard  # noqa: E402
from lightning_helpers import TPMLP  # noqa: E402
from lightning_helpers import StepBatches, StepCounter  # noqa: E402
from trainer_scenarios import CountingBarriers, committed  # noqa: E402

TIMEOUT = timedelta(seconds=90)  # a hang fails the test instead of blocking it


class MPModel(LightningModule):
    """``fc2(gelu(fc1(x)))``: fc1 column-parallel and fc2 row-parallel over the TP mesh, then FSDP2
    over the DP mesh; the same global weights under every split."""

    def __init__(self, total_steps: int = 6, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        self.fc1, self.fc2 = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)
        self.losses: Dict[int, float] = {}
        self.test_losses: List[float] = []

    def configure_model(self) -> None:
        if self.device_mesh is None:  # a stock strategy (DDP): the plain module
            return
        tp, dp = self.device_mesh["tensor_parallel"], self.device_mesh["data_parallel"]
        if tp.size() > 1:
            parallelize_module(self, tp, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
        for layer in (self.fc1, self.fc2, self):
            fully_shard(layer, mesh=dp)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self.fc2(F.gelu(self.fc1(x))), y)
        value = loss.detach().clone()
        dist.all_reduce(value)  # TP ranks hold the same loss: the world mean is the global batch's
        self.losses[self.global_step] = (value / dist.get_world_size()).item()
        return loss

    def test_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        value = F.mse_loss(self.fc2(F.gelu(self.fc1(x))), y).detach().clone()
        dist.all_reduce(value)
        self.test_losses.append((value / dist.get_world_size()).item())

    def test_dataloader(self) -> StepBatches:
        """Step 3's batch: under the step-3 checkpoint its loss is the logged training loss of step 3."""
        if self.device_mesh is None:
            rank, size = self.trainer.global_rank, self.trainer.world_size
        else:
            rank, size = self.device_mesh["data_parallel"].get_local_rank(), self.device_mesh["data_parallel"].size()
        return StepBatches(3, 4, 8, 8, 4, rank, size)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.7)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self) -> StepBatches:
        if self.device_mesh is None:  # DDP: every rank is a data-parallel rank
            rank, size = self.trainer.global_rank, self.trainer.world_size
        else:
            rank, size = self.device_mesh["data_parallel"].get_local_rank(), self.device_mesh["data_parallel"].size()
        return StepBatches(self.trainer.global_step, self.hparams.total_steps, 8, 8, 4, rank, size)


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def full_state(model: MPModel, trainer_: Trainer) -> Dict[str, torch.Tensor]:
    """Whole weights and AdamW state by parameter name (collective: DTensors are gathered)."""
    out = {}
    opt = trainer_.optimizers[0]
    for name, p in model.named_parameters():
        out[name] = _full(p)
        for k, v in sorted(opt.state[p].items()):
            out[f"{name}.{k}"] = _full(v)
    return out


def same(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor]) -> Dict[str, bool]:
    return {k: k in b and torch.equal(a[k], b[k].to(a[k].dtype)) for k in a}


def trainer(args: argparse.Namespace, max_steps: int, callbacks: List[Any] = (), dp: int = -1, tp: int = 1,
            **strategy_kw: Any) -> Trainer:
    dp = args.devices // tp if dp < 0 else dp
    strategy = DistCheckpointModelParallelStrategy(data_parallel_size=dp, tensor_parallel_size=tp, timeout=TIMEOUT,
                                                   **strategy_kw)
    return Trainer(accelerator="cpu", devices=args.devices, strategy=strategy, max_steps=max_steps, max_epochs=-1,
                   callbacks=list(callbacks), logger=False, enable_progress_bar=False, enable_model_summary=False,
                   num_sanity_val_steps=0, default_root_dir=args.dir)  # its default checkpoints/: not in the cwd


class Restored(Callback):
    """On train start (after the restore): the whole state equals the stored one read whole."""

    def __init__(self, stored: Dict[str, Any], res: Dict[str, Any], tag: str) -> None:
        self.stored, self.res, self.tag = stored, res, tag

    def on_train_start(self, trainer_: Trainer, module: Any) -> None:
        got = full_state(module, trainer_)
        opt = self.stored["optimizer_states"][0]
        names = [n for n, _ in module.named_parameters()]
        want = {}
        for j, name in enumerate(names):  # the stored dict read whole: torch's layout, by index
            want[name] = self.stored["state_dict"][name]
            for k, v in opt["state"][j].items():
                want[f"{name}.{k}"] = v if isinstance(v, torch.Tensor) else torch.tensor(v)
        self.res[self.tag] = {
            "state": same(want, got), "global_step": trainer_.global_step,
            "sched": trainer_.lr_scheduler_configs[0].scheduler.state_dict() == self.stored["lr_schedulers"][0],
            "lr": [g["lr"] for g in trainer_.optimizers[0].param_groups] == [g["lr"] for g in opt["param_groups"]],
            "callback_count": next(cb.count for cb in trainer_.callbacks if isinstance(cb, StepCounter)),
        }


def _tensors(state: Dict[str, torch.Tensor]) -> Dict[str, List[float]]:
    return {k: v.flatten().tolist() for k, v in state.items()}


def train_dp2(args: argparse.Namespace, res: Dict[str, Any]) -> None:
    """DP 2 (FSDP2): 6 steps uninterrupted; 3 steps with ModelCheckpoint (save_last) then resumed
    from ``ckpt_path="last"``; the same with async saves, and with their snapshot copied in the
    background (``background_snapshot``). Every resumed run must end bit-exact."""
    ref = MPModel()
    t = trainer(args, 6)
    t.fit(ref)
    res["ref_losses"] = ref.losses
    ref_state = full_state(ref, t)
    res["ref_state"] = _tensors(ref_state)
    for tag, kw in (("sync", {}), ("async", {"checkpoint": {"async_save": True}}),
                    ("async_bg", {"checkpoint": {"async_save": True, "background_snapshot": True}})):
        ck = os.path.join(args.dir, tag)
        cb = ModelCheckpoint(dirpath=ck, filename="{step}", every_n_train_steps=3, save_last=True, save_top_k=-1)
        trainer(args, 3, [cb, StepCounter()], **kw).fit(MPModel())
        model = MPModel()
        cb = ModelCheckpoint(dirpath=ck, filename="{step}", every_n_train_steps=3, save_last=True, save_top_k=-1)
        stored = DistCheckpointIO().load_checkpoint(os.path.join(ck, "last.ckpt"))
        t = trainer(args, 6, [cb, StepCounter(), Restored(stored, res, f"{tag}_restored")], **kw)
        t.fit(model, ckpt_path="last")
        res[f"{tag}_losses"] = model.losses
        res[f"{tag}_final"] = same(ref_state, full_state(model, t))
        res[f"{tag}_files"] = sorted(os.listdir(ck))


def resume_split(args: argparse.Namespace, res: Dict[str, Any]) -> None:
    """Resume DP 2's step-3 checkpoint under this run's split: TP = ``args.tp``, DP = the rest."""
    source = os.path.join(args.dir, "sync", "step=3.ckpt")
    stored = DistCheckpointIO().load_checkpoint(source)
    model = MPModel()
    t = trainer(args, 6, [StepCounter(), Restored(stored, res, "restored")], tp=args.tp)
    t.fit(model, ckpt_path=source)
    res["losses"] = model.losses
    res["final_step"] = t.global_step
    tested = MPModel()  # Trainer.test from the checkpoint: the weights only (no optimizer exists)
    trainer(args, 1, tp=args.tp).test(tested, ckpt_path=source, verbose=False)
    res["test_losses"] = tested.test_losses


def to_stock_ddp(args: argparse.Namespace, res: Dict[str, Any]) -> None:
    """Borders: the DP 2 step-3 checkpoint resumed by stock DDP with DistCheckpointIO (read whole, the
    optimizer state in torch's layout), and converted to one file that stock DDP resumes alone."""
    source = os.path.join(args.dir, "sync", "step=3.ckpt")
    stored = DistCheckpointIO().load_checkpoint(source)
    exported = os.path.join(args.dir, "mp-step3.ckpt")
    if dist.get_rank() == 0:
        export_torch_file(source, exported)
    for tag, path, plugins in (("plugin", source, [DistCheckpointIO()]), ("exported", exported, [])):
        model = MPModel()
        t = Trainer(accelerator="cpu", devices=args.devices, strategy=DDPStrategy(timeout=TIMEOUT), max_steps=6,
                    max_epochs=-1, callbacks=[StepCounter(), Restored(stored, res, f"{tag}_restored")], logger=False,
                    enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, plugins=plugins)
        t.fit(model, ckpt_path=path)
        res[f"{tag}_losses"] = model.losses


def from_stock_ddp(args: argparse.Namespace, res: Dict[str, Any]) -> None:
    """Borders: what stock DDP saved (a torch.save .ckpt file; a DistCheckpointIO directory) resumed
    by the subclass under DP 1 x TP ``args.tp``: each rank reads its slices; training goes on."""
    for tag, plugins in (("stock_file", []), ("plugin_dir", [DistCheckpointIO()])):
        ck = os.path.join(args.dir, tag)
        cb = ModelCheckpoint(dirpath=ck, filename="ddp", every_n_train_steps=3)
        Trainer(accelerator="cpu", devices=args.devices, strategy=DDPStrategy(timeout=TIMEOUT), max_steps=3,
                max_epochs=-1, callbacks=[cb, StepCounter()], logger=False, enable_progress_bar=False,
                enable_model_summary=False, plugins=plugins).fit(MPModel())
        source = os.path.join(ck, "ddp.ckpt")
        stored = torch.load(source, weights_only=False) if os.path.isfile(source) else \
            DistCheckpointIO().load_checkpoint(source)
        model = MPModel()
        t = trainer(args, 6, [StepCounter(), Restored(stored, res, f"{tag}_restored")], tp=args.tp)
        t.fit(model, ckpt_path=source)
        res[f"{tag}_losses"] = model.losses


class RestoredTP(Callback):
    """Under DistCheckpointStrategy (TPMLP): each rank's shards equal the stored tensors sliced."""

    def __init__(self, stored: Dict[str, Any], res: Dict[str, Any]) -> None:
        self.stored, self.res = stored, res

    def on_train_start(self, trainer_: Trainer, module: Any) -> None:
        ps, opt = module.ps, trainer_.optimizers[0]
        state = self.stored["optimizer_states"][0]["state"]
        ok = {}
        for j, (name, p) in enumerate(module.named_parameters()):
            whole = self.stored["state_dict"][name]
            ok[name] = torch.equal(p.detach(), expected_shard(name, whole, ps.tp_rank, ps.tp_size))
            for k, v in opt.state[p].items():
                want = state[j][k] if isinstance(state[j][k], torch.Tensor) else torch.tensor(state[j][k])
                ok[f"{name}.{k}"] = torch.equal(v, expected_shard(name, want, ps.tp_rank, ps.tp_size))
        self.res["tp_restored"] = {
            "state": ok, "global_step": trainer_.global_step, "lr": True,
            "sched": trainer_.lr_scheduler_configs[0].scheduler.state_dict() == self.stored["lr_schedulers"][0],
            "callback_count": next(cb.count for cb in trainer_.callbacks if isinstance(cb, StepCounter))}


def to_tp_strategy(args: argparse.Namespace, res: Dict[str, Any]) -> None:
    """Border: the DP 2 step-3 checkpoint resumed by DistCheckpointStrategy(tensor_parallel_size=2)."""
    source = os.path.join(args.dir, "sync", "step=3.ckpt")
    model = TPMLP(total_steps=6)
    t = Trainer(accelerator="cpu", devices=args.devices, max_steps=6, max_epochs=-1,
                strategy=DistCheckpointStrategy(tensor_parallel_size=2, timeout=TIMEOUT), logger=False,
                callbacks=[StepCounter(), RestoredTP(DistCheckpointIO().load_checkpoint(source), res)],
                enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
    t.fit(model, ckpt_path=source)
    res["tp_losses"] = model.losses


def refuse_plugin_dir(args: argparse.Namespace, res: Dict[str, Any]) -> None:
    """What fabric.save wrote (through the plugin; stock, a torch.save file): refused, naming the writer."""
    paths = {"refused": os.path.join(args.dir, "fabric_like"), "refused_file": os.path.join(args.dir, "fabric.pt")}
    if not dist.is_initialized() or dist.get_rank() == 0:
        DistCheckpointIO().save_checkpoint({"model": {"fc1.weight": torch.zeros(16, 8)}, "step": 3}, paths["refused"])
        torch.save({"model": {"fc1.weight": torch.zeros(16, 8)}, "step": 3}, paths["refused_file"])
    for tag, path in paths.items():
        try:
            trainer(args, 4).fit(MPModel(), ckpt_path=path)
            res[tag] = "no error"
        except CheckpointingError as e:
            res[tag] = f"{type(e).__name__}: {e}"


class FailsTreeOnRank1(Callback):
    """At step 1, ``trainer.save_checkpoint`` with rank 1's state dict holding itself (its tree cannot be
    built): records the error every rank raised and whether anything was written."""

    def __init__(self, path: str, res: Dict[str, Any]) -> None:
        self.path, self.res, self.armed = path, res, False

    def on_save_checkpoint(self, trainer_: Trainer, module: Any, checkpoint: Dict[str, Any]) -> None:
        if self.armed and trainer_.global_rank == 1:
            cycle: List[Any] = []
            cycle.append(cycle)
            checkpoint["state_dict"]["cycle"] = cycle

    def on_train_batch_end(self, trainer_: Trainer, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer_.global_step != 1:
            return
        self.armed = True
        try:
            trainer_.save_checkpoint(self.path)
            self.res["tree_fails"] = "no error"
        except CheckpointingError as e:
            self.res["tree_fails"] = f"{type(e).__name__}: {e}"
        finally:
            self.armed = False
        self.res["tree_fails_written"] = sorted(os.listdir(os.path.dirname(self.path)))


def save_barrier(args: argparse.Namespace, res: Dict[str, Any]) -> None:
    """Trainer.save_checkpoint's barrier after a save is left out, sync and async; a rank failing to
    build its tree fails the save on every rank (agreed by the save's handshake), nothing written."""
    for name, cfg in (("sync", {}), ("async", {"checkpoint": {"async_save": True}})):
        seen: Dict[str, Any] = {}
        path = os.path.join(args.dir, "barrier", name)
        trainer(args, 2, [CountingBarriers(path, seen)], **cfg).fit(MPModel(total_steps=2))
        res[f"barrier_{name}"] = {k: v for k, v in seen.items() if k != "torch_saves"}
        res[f"barrier_{name}_committed_after_fit"] = committed(path)
    os.makedirs(os.path.join(args.dir, "treefail"), exist_ok=True)
    trainer(args, 2, [FailsTreeOnRank1(os.path.join(args.dir, "treefail", "ckpt"), res)]).fit(MPModel(total_steps=2))


SCENARIOS = {"train_dp2": train_dp2, "to_stock_ddp": to_stock_ddp, "from_stock_ddp": from_stock_ddp,
             "to_tp_strategy": to_tp_strategy, "resume_split": resume_split, "refuse_plugin_dir": refuse_plugin_dir,
             "save_barrier": save_barrier}


if __name__ == "__main__":
    scenario_main(SCENARIOS)
