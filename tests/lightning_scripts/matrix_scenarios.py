"""Border-matrix cells (docs/lightning.md section 7) on 2 gloo processes, for tests/lightning/test_borders_matrix.py:
``python matrix_scenarios.py all --dir D --out OUT`` (Lightning / Fabric launch the second rank).

Each writer saves once, at its 2-process split (stock DDP and the plugin: DP 2; the TP strategies: TP 2;
the ModelParallel strategies: DP 2 (FSDP2)); every loader of its row that no other test covers is
tried against it in the same process group (the Trainer ModelParallel subclass at DP 1 x TP 2, the
Fabric TP strategy at TP 2). Each cell's outcome ("ok" or "<Error>: <message>") and, for the cells
that load, the bit-exact comparison of every weight and Adam state with the tensors the writer held,
go to ``OUT.rank<r>.json``."""

from __future__ import annotations

import argparse
import os
import sys
from datetime import timedelta
from typing import Any, Callable, Dict, Iterable

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from scenario_runner import scenario_main  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from lightning.fabric import Fabric  # noqa: E402
from lightning.fabric.strategies import DDPStrategy as FabricDDP  # noqa: E402
from lightning.fabric.strategies import ModelParallelStrategy as FabricModelParallel  # noqa: E402
from lightning.pytorch import Callback, Trainer  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy  # noqa: E402

from lightning_distckpt.lightning import (DistCheckpointIO, DistCheckpointModelParallelStrategy,  # noqa: E402
                                         DistCheckpointStrategy, FabricDistCheckpointStrategy, export_torch_file,
                                         load_module_weights)
from lightning_distckpt.lightning.fabric_model_parallel import FabricDistCheckpointModelParallelStrategy  # noqa: E402
from lightning_helpers import TPMLP, full_weights, optimizer_full_state  # noqa: E402
from fabric_scenarios import Run as TPRun  # noqa: E402
from fabric_model_parallel_scenarios import MLP, parallelize  # noqa: E402
from fabric_model_parallel_scenarios import Run as MPRun  # noqa: E402
from model_parallel_scenarios import MPModel, full_state  # noqa: E402
from border_fabric import StockRun  # noqa: E402

DEVICES = 2
TIMEOUT = timedelta(seconds=120)
Tensors = Dict[str, torch.Tensor]


def outcome(fn: Callable[[], Any]) -> str:
    try:
        fn()
        return "ok"
    except Exception as e:  # the cell's behaviour is the outcome
        return f"{type(e).__name__}: {e}"[:2000]


# -- the writers' and readers' setups, at their 2-process splits ------------------------------------
def fabric(strategy: Any, plugins: Any = None) -> Fabric:
    f = Fabric(accelerator="cpu", devices=DEVICES, strategy=strategy, plugins=plugins)
    f.launch()
    return f


def fabric_stock() -> Fabric:
    return fabric(FabricDDP(timeout=TIMEOUT))


def fabric_plugin() -> Fabric:
    return fabric(FabricDDP(timeout=TIMEOUT), plugins=[DistCheckpointIO()])


def fabric_tp() -> Fabric:
    return fabric(FabricDistCheckpointStrategy(tensor_parallel_size=2, timeout=TIMEOUT))


def fabric_mp() -> Fabric:
    return fabric(FabricDistCheckpointModelParallelStrategy(parallelize, data_parallel_size=2, tensor_parallel_size=1,
                                                            timeout=TIMEOUT))


def trainer(strategy: Any, plugins: Any = None, max_steps: int = 2, callbacks: Any = None) -> Trainer:
    return Trainer(accelerator="cpu", devices=DEVICES, strategy=strategy, plugins=plugins, max_steps=max_steps,
                   max_epochs=-1, callbacks=callbacks, logger=False, enable_progress_bar=False,
                   enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0)


def t_plugin(max_steps: int = 4) -> Trainer:
    return trainer(DDPStrategy(timeout=TIMEOUT), plugins=[DistCheckpointIO()], max_steps=max_steps)


def t_tp(max_steps: int = 4) -> Trainer:
    return trainer(DistCheckpointStrategy(tensor_parallel_size=2, timeout=TIMEOUT), max_steps=max_steps)


def t_mp(max_steps: int = 4, dp: int = 1, tp: int = 2, callbacks: Any = None) -> Trainer:
    return trainer(DistCheckpointModelParallelStrategy(data_parallel_size=dp, tensor_parallel_size=tp,
                                                       timeout=TIMEOUT), max_steps=max_steps, callbacks=callbacks)


# -- what a run holds, whole, by parameter name: "fc1.weight", "fc1.weight.exp_avg", ... ---------------
def held(named_params: Iterable[Any], opt_state: Any) -> Tensors:
    out = {}
    for name, p in named_params:
        out[name] = p.detach().clone()
        for k, v in opt_state[p].items():
            out[f"{name}.{k}"] = v.detach().clone()
    return out


def held_tp(run: TPRun) -> Tensors:
    """A TP 2 Fabric run's state gathered over TP, keyed as :func:`held` keys it."""
    return {(k[:-2] if k.endswith(".w") else k): v for k, v in run.full().items()}


def equal(got: Tensors, saved: Tensors) -> Dict[str, bool]:
    """Each tensor the writer held equals the reader's, bit for bit (a scalar step compared in the writer's dtype)."""
    return {k: k in got and torch.equal(got[k].to(v.dtype), v) for k, v in saved.items()}


# -- the readers: each gets a path, does what a user would; what it loaded, by parameter name ----------
def f_plugin(path: str) -> Tensors:
    run = StockRun(fabric_plugin())
    run.fabric.load(path, {"model": run.model, "optimizer": run.opt})
    return held(run.model.module.named_parameters(), run.opt.optimizer.state)


def f_tp(path: str) -> Tensors:
    run = TPRun(fabric_tp())
    run.fabric.load(path, {"model": run.model, "optimizer": run.opt})
    return held_tp(run)


def f_mp(path: str) -> Tensors:
    run = MPRun(fabric_mp())
    run.fabric.load(path, {"model": run.model, "optimizer": run.opt})
    return run.full()


def converted(path: str, out: str) -> Tensors:
    """``convert DIR OUT.pt`` (each rank its own file: no collective), then torch.load(weights_only=True):
    Lightning's dict or Fabric's ({"model", "optimizer"}), optimizer state in torch's layout, as
    :func:`held` keys it."""
    out = f"{out}.rank{dist.get_rank()}"
    export_torch_file(path, out)
    whole = torch.load(out, weights_only=True)
    model, opt = ((whole["state_dict"], whole["optimizer_states"][0]) if "state_dict" in whole
                  else (whole["model"], whole["optimizer"]))
    got = dict(model)
    for j, name in enumerate(model):  # torch's layout: by index, in the module's order
        for k, v in opt["state"][j].items():
            got[f"{name}.{k}"] = v
    return got


def inference(path: str, entry: str = "model") -> Tensors:
    module = MLP()
    load_module_weights(module, path, entry=entry)
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


class Captured(Callback):
    """On train start (after the restore): the whole state, step and scheduler the Trainer resumed with."""

    def __init__(self) -> None:
        self.got: Dict[str, Any] = {}

    def on_train_start(self, trainer_: Trainer, module: Any) -> None:
        self.got = {"state": full_state(module, trainer_), "step": trainer_.global_step,
                    "sched": trainer_.lr_scheduler_configs[0].scheduler.state_dict()}


def resumed_t_mp(path: str, saved: Tensors, sched: Dict[str, Any]) -> Dict[str, Any]:
    """``fit(ckpt_path=path)`` under the Trainer ModelParallel subclass (DP 1 x TP 2): what it resumed
    with, against the writer's whole state and scheduler; the step it ended at; its next save's format."""
    cap = Captured()
    t = t_mp(callbacks=[cap])
    t.fit(MPModel(total_steps=4), ckpt_path=path)
    t.save_checkpoint(path + ".resaved")
    return {"equal": equal(cap.got["state"], saved), "step": cap.got["step"], "sched": cap.got["sched"] == sched,
            "final_step": t.global_step, "resaved_step": DistCheckpointIO().load_checkpoint(path + ".resaved")[
                "global_step"]}


def weights(saved: Tensors) -> Tensors:
    """The weights alone (no optimizer state) of what :func:`held` returns."""
    return {k: v for k, v in saved.items() if k.count(".") == 1}


def try_cell(res: Dict[str, Any], cell: str, fn: Callable[[], Any], saved: Tensors = None) -> None:
    """Run one cell: its outcome under ``cell``; what it loaded compared with ``saved`` under ``cell_equal``."""
    got: Dict[str, Any] = {}
    res[cell] = outcome(lambda: got.update(fn() or {}))
    if saved is not None and res[cell] == "ok":
        res[f"{cell}_equal"] = equal(got, saved)


def try_row(res: Dict[str, Any], row: str, path: str, saved: Tensors, columns: Iterable[str], entry: str) -> None:
    """Every reader of ``columns`` against the checkpoint at ``path``; what loads is compared with ``saved``
    (inference: the weights alone, read from ``entry``)."""
    for col in columns:
        if col == "inference":
            try_cell(res, f"{row}_{col}", lambda: inference(path, entry), weights(saved))
        else:
            try_cell(res, f"{row}_{col}", lambda: READERS[col](path), saved)


READERS: Dict[str, Callable[[str], Any]] = {
    "t_plugin": lambda p: t_plugin().fit(TPMLP(total_steps=4), ckpt_path=p),
    "t_tp": lambda p: t_tp().fit(TPMLP(total_steps=4), ckpt_path=p),
    "t_mp": lambda p: t_mp().fit(MPModel(total_steps=4), ckpt_path=p),
    "f_plugin": f_plugin, "f_tp": f_tp, "f_mp": f_mp, "convert": lambda p: converted(p, p + ".pt"),
}
TRAINERS = ("t_plugin", "t_tp", "t_mp")


# -- the rows ------------------------------------------------------------------------------------------
def held_stock(run: StockRun) -> Tensors:
    return held(run.model.module.named_parameters(), run.opt.optimizer.state)


def fabric_rows(args: argparse.Namespace, res: Dict[str, Any]) -> None:
    """Rows written by fabric.save (2 steps trained, then saved once): stock Fabric DDP (a torch.save
    file), Fabric + the plugin, Fabric + TP 2, Fabric + the ModelParallel subclass (DP 2), Fabric's own
    ModelParallelStrategy (DP 2, DCP + meta.pt)."""
    def stock_mp() -> MPRun:
        return MPRun(fabric(FabricModelParallel(parallelize, data_parallel_size=2, tensor_parallel_size=1,
                                                timeout=TIMEOUT)))
    rows = [("sf", "stock_fabric.pt", lambda: StockRun(fabric_stock()), held_stock, (*TRAINERS, "inference", "f_mp")),
            ("fpl", "fabric_plugin", lambda: StockRun(fabric_plugin()), held_stock,
             (*TRAINERS, "f_plugin", "convert", "inference", "f_mp")),
            ("ftp", "ftp", lambda: TPRun(fabric_tp()), held_tp, (*TRAINERS, "convert", "inference", "f_mp")),
            ("fmp", "fmp", lambda: MPRun(fabric_mp()), MPRun.full,
             (*TRAINERS, "f_plugin", "f_tp", "f_mp", "convert", "inference")),
            ("fdcp", "fabric_dcp", stock_mp, MPRun.full, ("t_mp", "f_mp"))]
    for row, name, make, saved_of, columns in rows:
        path = os.path.join(args.dir, name)
        run = make()
        run.train(0, 2)
        saved = saved_of(run)
        run.fabric.save(path, {"model": run.model, "optimizer": run.opt, "step": 2})
        try_row(res, row, path, saved, columns, entry="model")


def trainer_rows(args: argparse.Namespace, res: Dict[str, Any]) -> None:
    """Rows written by a Trainer (2 steps, then ``save_checkpoint`` once): stock DDP (a .ckpt file), DDP +
    the plugin, the TP strategy (TP 2), the ModelParallel subclass (DP 2), Lightning's own
    ModelParallelStrategy (DP 2, a DCP directory), which the Trainer ModelParallel subclass resumes."""
    def held_ddp(model: Any, t: Trainer) -> Tensors:
        return held(model.named_parameters(), t.optimizers[0].state)

    def held_tpmlp(model: Any, t: Trainer) -> Tensors:
        return {**full_weights(model), **optimizer_full_state(model, t.optimizers[0])}

    def stock_mp() -> Trainer:
        return trainer(ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1, timeout=TIMEOUT))
    rows = [("stock", "stock.ckpt", lambda: trainer(DDPStrategy(timeout=TIMEOUT)), TPMLP, held_ddp,
             ("f_plugin", "f_mp", "inference")),
            ("tpl", "tplugin", lambda: t_plugin(2), TPMLP, held_ddp,
             ("f_plugin", "f_tp", "f_mp", "convert", "inference")),
            ("ttp", "ttp.ckpt", lambda: t_tp(2), TPMLP, held_tpmlp, ("t_mp", "f_plugin", "f_tp", "f_mp", "inference")),
            ("tmp", "tmp.ckpt", lambda: t_mp(2, dp=2, tp=1), MPModel, full_state, ("f_plugin", "f_tp", "f_mp")),
            ("dcp", "lightning_dcp", stock_mp, MPModel, full_state,
             ("t_plugin", "t_tp", "f_plugin", "f_tp", "f_mp", "convert"))]
    for row, name, make, module, saved_of, columns in rows:
        path = os.path.join(args.dir, name)
        t, model = make(), module(total_steps=2)
        t.fit(model)
        saved, sched = saved_of(model, t), t.lr_scheduler_configs[0].scheduler.state_dict()
        t.save_checkpoint(path)
        try_row(res, row, path, saved, columns, entry="state_dict")
    # The last row, Lightning's DCP directory, resumed by the Trainer ModelParallel subclass.
    res["dcp_t_mp"] = outcome(lambda: res.update(dcp_t_mp_resumed=resumed_t_mp(path, saved, sched)))


if __name__ == "__main__":
    scenario_main({"fabric_rows": fabric_rows, "trainer_rows": trainer_rows})
