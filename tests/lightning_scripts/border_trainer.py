"""Trainer runs across checkpoint borders for tests/lightning/test_borders*.py: ``python border_trainer.py SCENARIO...``.

Every rank writes ``OUT.rank<r>.json`` (see trainer_scenarios.py for the conventions).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Dict

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # tests/ (lightning_helpers)

from scenario_runner import scenario_main  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch import Callback, Trainer  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy  # noqa: E402

from lightning_distckpt import CheckpointingError  # noqa: E402
from lightning_distckpt.lightning import DistCheckpointIO, DistCheckpointStrategy, export_torch_file  # noqa: E402
from lightning_helpers import TPMLP, StepCounter  # noqa: E402
from trainer_scenarios import TIMEOUT, trainer  # noqa: E402

#: The axis each TPMLP parameter is split on under TP (others are replicated).
TP_AXIS = {"fc1.weight": 0, "fc1.bias": 0, "fc2.weight": 1}


def expected_shard(name: str, whole: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    axis = TP_AXIS.get(name)
    if axis is None or whole.ndim == 0:
        return whole
    return whole.chunk(tp_size, dim=axis)[tp_rank]


class RestoredState(Callback):
    """On train start (after the restore): does the state equal the stored one, sliced for this rank?"""

    def __init__(self, stored: Dict[str, Any], res: Dict[str, Any], tag: str) -> None:
        self.stored, self.res, self.tag = stored, res, tag

    def on_train_start(self, trainer_: Trainer, module: Any) -> None:
        ps = module.ps
        opt = trainer_.optimizers[0]
        names = [n for n, _ in module.named_parameters()]
        weights, moments = {}, {}
        for j, (name, p) in enumerate(module.named_parameters()):
            weights[name] = torch.equal(p.detach(), expected_shard(name, self.stored["weights"][name], ps.tp_rank, ps.tp_size))
            for k, v in opt.state[p].items():
                moments[f"{name}.{k}"] = torch.equal(
                    v, expected_shard(name, self.stored["opt_state"][j][k], ps.tp_rank, ps.tp_size))
        self.res[self.tag] = {
            "params": names, "weights": weights, "moments": moments,
            "global_step": trainer_.global_step, "epoch": trainer_.current_epoch,
            "sched": trainer_.lr_scheduler_configs[0].scheduler.state_dict() == self.stored["sched"],
            "lr": [g["lr"] for g in opt.param_groups] == [g["lr"] for g in self.stored["param_groups"]],
            "callback_count": next(cb.count for cb in trainer_.callbacks if isinstance(cb, StepCounter)),
            "best_model_score": (trainer_.checkpoint_callback is not None and
                                 float(trainer_.checkpoint_callback.best_model_score) == self.stored["best_score"]),
        }


def stored_of(path: str) -> Dict[str, Any]:
    """The stored state of a stock .ckpt file (read with torch.load) or a plugin directory."""
    ckpt = torch.load(path, weights_only=False) if os.path.isfile(path) else DistCheckpointIO().load_checkpoint(path)
    opt = ckpt["optimizer_states"][0]
    return {"weights": ckpt["state_dict"], "opt_state": opt["state"], "param_groups": opt["param_groups"],
            "sched": ckpt["lr_schedulers"][0], "global_step": ckpt["global_step"],
            "best_score": next(float(v["best_model_score"]) for k, v in ckpt["callbacks"].items() if "ModelCheckpoint" in k)}


def resume_under_tp(args: argparse.Namespace, res: Dict[str, Any], source: str, tag: str, checkpoint_dir: str) -> None:
    """Resume ``source`` under DistCheckpointStrategy(tensor_parallel_size=2) and train to step 6
    (with the ModelCheckpoint that saved it, whose state comes back)."""
    stored = stored_of(source)
    model = TPMLP(total_steps=6)
    cb = ModelCheckpoint(dirpath=checkpoint_dir, filename="tp2-{step}", monitor="train_loss", every_n_train_steps=3)
    t = trainer(args, DistCheckpointStrategy(tensor_parallel_size=2, timeout=TIMEOUT), 6,
                [RestoredState(stored, res, tag), StepCounter(), cb])
    t.fit(model, ckpt_path=source)
    res[f"{tag}_losses"] = dict(model.losses)
    res[f"{tag}_final_step"] = t.global_step


def stock_ddp(args: argparse.Namespace, res: Dict[str, Any]) -> None:
    """Stock DDP (TP 1 x DP 2) trains 3 steps and saves one ``torch.save`` file; the TP 2 strategy
    resumes from it and trains on; a stock run of 6 steps gives the reference losses."""
    ref = TPMLP(total_steps=6)
    trainer(args, DDPStrategy(timeout=TIMEOUT), 6, enable_checkpointing=False).fit(ref)
    res["ref_losses"] = dict(ref.losses)
    ck = os.path.join(args.dir, "stock")
    cb = ModelCheckpoint(dirpath=ck, filename="stock", monitor="train_loss", every_n_train_steps=3)
    trainer(args, DDPStrategy(timeout=TIMEOUT), 3, [cb, StepCounter()]).fit(TPMLP(total_steps=6))
    resume_under_tp(args, res, os.path.join(ck, "stock.ckpt"), "stock", checkpoint_dir=ck)
    source = os.path.join(ck, "stock.ckpt")
    # Trainer.test from the stock file under TP 2: the weights only, each rank its shards.
    tested = TPMLP(total_steps=6)
    trainer(args, DistCheckpointStrategy(tensor_parallel_size=2, timeout=TIMEOUT), 1,
            enable_checkpointing=False).test(tested, ckpt_path=source, verbose=False)
    res["stock_test_loss"] = tested.test_losses
    # The same file under stock DDP with the plugin: DistCheckpointIO reads a torch.save file as it is.
    cb = ModelCheckpoint(dirpath=ck, filename="plugin-{step}", monitor="train_loss", every_n_train_steps=3)
    t = trainer(args, DDPStrategy(timeout=TIMEOUT), 6, [RestoredState(stored_of(source), res, "stock_plugin"),
                                                        StepCounter(), cb], plugins=[DistCheckpointIO()])
    t.fit(TPMLP(total_steps=6), ckpt_path=source)


def plugin_ddp(args: argparse.Namespace, res: Dict[str, Any]) -> None:
    """The same from a directory DistCheckpointIO wrote under stock DDP (tensors by path, scalars common)."""
    ck = os.path.join(args.dir, "plugin")
    cb = ModelCheckpoint(dirpath=ck, filename="{step}", monitor="train_loss", every_n_train_steps=3)
    t = trainer(args, DDPStrategy(timeout=TIMEOUT), 3, [cb, StepCounter()], plugins=[DistCheckpointIO()])
    t.fit(TPMLP(total_steps=6))
    resume_under_tp(args, res, os.path.join(ck, "step=3.ckpt"), "plugin", checkpoint_dir=ck)


def no_sharded_state_dict(args: argparse.Namespace, res: Dict[str, Any]) -> None:
    """Defect 5: a module with TP layers whose tree describes no shard is refused at setup."""
    class Plain(TPMLP):
        def configure_model(self) -> None:
            super().configure_model()
            self.fc1 = torch.nn.Linear(8, 8)  # nothing left that describes a shard
            self.fc2 = torch.nn.Linear(8, 4)

        sharded_state_dict = None  # type: ignore[assignment]  # the module defines none

    model = Plain(total_steps=2)
    t = trainer(args, DistCheckpointStrategy(tensor_parallel_size=2, timeout=TIMEOUT), 2, enable_checkpointing=False)
    try:
        t.fit(model)
        res["no_ssd"] = "no error"
    except CheckpointingError as e:
        res["no_ssd"] = f"{type(e).__name__}: {e}"
    res["no_ssd_steps_trained"] = len(model.losses)


def strategy_to_plugin(args: argparse.Namespace, res: Dict[str, Any]) -> None:
    """Border: a TP 2 checkpoint of the strategy resumed by stock DDP with the plugin (each tensor
    read whole; the optimizer state comes back in torch's layout)."""
    ck = os.path.join(args.dir, "tp2")
    cb = ModelCheckpoint(dirpath=ck, filename="{step}", monitor="train_loss", every_n_train_steps=3)
    t = trainer(args, DistCheckpointStrategy(tensor_parallel_size=2, timeout=TIMEOUT), 3, [cb, StepCounter()])
    t.fit(TPMLP(total_steps=6))
    source = os.path.join(ck, "step=3.ckpt")
    stored = stored_of(source)
    model = TPMLP(total_steps=6)
    cb = ModelCheckpoint(dirpath=ck, filename="ddp-{step}", monitor="train_loss", every_n_train_steps=3)
    t = trainer(args, DDPStrategy(timeout=TIMEOUT), 6, [RestoredState(stored, res, "to_plugin"), StepCounter(), cb],
                plugins=[DistCheckpointIO()])
    t.fit(model, ckpt_path=source)
    res["to_plugin_final_step"] = t.global_step
    # convert to one torch.save file, then stock DDP without any plugin resumes it.
    exported = os.path.join(args.dir, "tp2-step3.ckpt")
    if torch.distributed.get_rank() == 0:
        export_torch_file(source, exported)
    torch.distributed.barrier()
    t = trainer(args, DDPStrategy(timeout=TIMEOUT), 6, [RestoredState(stored, res, "exported"), StepCounter()],
                enable_checkpointing=False)
    t.fit(TPMLP(total_steps=6), ckpt_path=exported)


def fabric_checkpoint_refused(args: argparse.Namespace, res: Dict[str, Any]) -> None:
    """Border: what fabric.save wrote (here through the plugin) is refused by the Trainer's strategy,
    saying who wrote it and what to do."""
    path = os.path.join(args.dir, "fabric_like")
    if torch.distributed.get_rank() == 0:
        DistCheckpointIO().save_checkpoint({"model": {"fc1.weight": torch.zeros(16, 8)}, "step": 3}, path)
    torch.distributed.barrier()
    t = trainer(args, DistCheckpointStrategy(tensor_parallel_size=2, timeout=TIMEOUT), 4, enable_checkpointing=False)
    try:
        t.fit(TPMLP(total_steps=4), ckpt_path=path)
        res["fabric_refused"] = "no error"
    except CheckpointingError as e:
        res["fabric_refused"] = f"{type(e).__name__}: {e}"


def stock_weights_only(args: argparse.Namespace, res: Dict[str, Any]) -> None:
    """A stock weights-only .ckpt: strict resume names what is missing; non-strict keeps a fresh optimizer."""
    ck = os.path.join(args.dir, "stock_wo")
    cb = ModelCheckpoint(dirpath=ck, filename="wo", every_n_train_steps=3, save_weights_only=True)
    trainer(args, DDPStrategy(timeout=TIMEOUT), 3, [cb]).fit(TPMLP(total_steps=6))
    source = os.path.join(ck, "wo.ckpt")
    try:
        trainer(args, DistCheckpointStrategy(tensor_parallel_size=2, timeout=TIMEOUT), 5,
                enable_checkpointing=False).fit(TPMLP(total_steps=5), ckpt_path=source)
        res["wo_strict"] = "no error"
    except CheckpointingError as e:
        res["wo_strict"] = f"{type(e).__name__}: {e}"
    model = TPMLP(total_steps=5)
    t = trainer(args, DistCheckpointStrategy(tensor_parallel_size=2, timeout=TIMEOUT, checkpoint={"strict": "log_all"}),
                5, enable_checkpointing=False)
    t.fit(model, ckpt_path=source)
    res["wo_global_step"] = t.global_step
    res["wo_fc1_opt_step"] = float(t.optimizers[0].state[model.fc1.weight]["step"])  # fresh: 2 steps


SCENARIOS = {"stock_weights_only": stock_weights_only, "stock_ddp": stock_ddp, "plugin_ddp": plugin_ddp, "no_sharded_state_dict": no_sharded_state_dict,
             "strategy_to_plugin": strategy_to_plugin, "fabric_checkpoint_refused": fabric_checkpoint_refused}


if __name__ == "__main__":
    scenario_main(SCENARIOS)
