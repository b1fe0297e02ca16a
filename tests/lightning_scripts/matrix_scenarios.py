"""Border-matrix cells (docs/lightning.md section 7) run in ONE process (devices=1, a gloo group of one)
for tests/test_borders_matrix.py: ``python matrix_scenarios.py all --dir D --out OUT``. Each writer
saves once; every loader of its row is tried in turn and its outcome ("ok" or "<Error>: <message>")
written to ``OUT.rank0.json``. The cells checked here refuse or load whatever the split, so one rank suffices."""

from __future__ import annotations

import argparse
import os
import sys
from datetime import timedelta
from typing import Any, Callable, Dict

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from scenario_runner import run_scenarios  # noqa: E402
import torch  # noqa: E402
from lightning.fabric import Fabric  # noqa: E402
from lightning.fabric.strategies import DDPStrategy as FabricDDP  # noqa: E402
from lightning.pytorch import Trainer  # noqa: E402

from lightning_distckpt.lightning import (DistCheckpointIO, DistCheckpointModelParallelStrategy,  # noqa: E402
                                         DistCheckpointStrategy, FabricDistCheckpointStrategy, load_module_weights)
from lightning_distckpt.lightning.fabric_model_parallel import FabricDistCheckpointModelParallelStrategy  # noqa: E402
from lightning_helpers import TPMLP  # noqa: E402
from fabric_scenarios import Run as TPRun  # noqa: E402
from fabric_model_parallel_scenarios import MLP, parallelize  # noqa: E402
from fabric_model_parallel_scenarios import Run as MPRun  # noqa: E402
from model_parallel_scenarios import MPModel  # noqa: E402
from border_fabric import StockRun  # noqa: E402

TIMEOUT = timedelta(seconds=90)


def outcome(fn: Callable[[], Any]) -> str:
    try:
        fn()
        return "ok"
    except Exception as e:  # the cell's behaviour is the outcome
        return f"{type(e).__name__}: {e}"[:2000]


def fabric(strategy: Any = "auto", plugins: Any = None) -> Fabric:
    f = Fabric(accelerator="cpu", devices=1, strategy=strategy, plugins=plugins)
    f.launch()
    return f


def fabric_plugin() -> Fabric:
    return fabric(FabricDDP(timeout=TIMEOUT), plugins=[DistCheckpointIO()])


def fabric_tp() -> Fabric:
    return fabric(FabricDistCheckpointStrategy(tensor_parallel_size=1, timeout=TIMEOUT))


def fabric_mp() -> Fabric:
    return fabric(FabricDistCheckpointModelParallelStrategy(parallelize, data_parallel_size=1, tensor_parallel_size=1,
                                                            timeout=TIMEOUT))


def trainer(strategy: Any = "auto", plugins: Any = None, max_steps: int = 2) -> Trainer:
    return Trainer(accelerator="cpu", devices=1, strategy=strategy, plugins=plugins, max_steps=max_steps, max_epochs=-1,
                   logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                   num_sanity_val_steps=0)


def t_plugin() -> Trainer:
    from lightning.pytorch.strategies import DDPStrategy
    return trainer(DDPStrategy(timeout=TIMEOUT), plugins=[DistCheckpointIO()], max_steps=4)


def t_mp(max_steps: int = 4) -> Trainer:
    return trainer(DistCheckpointModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1, timeout=TIMEOUT),
                   max_steps=max_steps)


def tp_run_load(path: str, full: bool = True) -> None:
    run = TPRun(fabric_tp())
    run.fabric.load(path, run.state(0) if full else {"model": run.model, "optimizer": run.opt})


def plugin_load(path: str, full: bool = True) -> Any:
    run = StockRun(fabric_plugin())
    run.fabric.load(path, run.state(0) if full else {"model": run.model, "optimizer": run.opt})
    return run


def same_as_saved(run: Any, saved: Dict[str, torch.Tensor]) -> Dict[str, bool]:
    """Each weight and Adam state of a TP 1 run equals the tensor the writer held (read back whole)."""
    out = {}
    for name, p in run.model.module.named_parameters():
        out[name] = torch.equal(p.detach(), saved[name])
        for k, v in run.opt.optimizer.state[p].items():
            out[f"{name}.{k}"] = torch.equal(v.to(saved[f"{name}.{k}"].dtype), saved[f"{name}.{k}"])
    return out


def all_cells(args: argparse.Namespace, res: Dict[str, Any]) -> None:
    d = args.dir
    # Row: Fabric + FabricDistCheckpointModelParallelStrategy.
    fmp = os.path.join(d, "fmp")
    run = MPRun(fabric_mp())
    run.train(0, 2)
    saved = {k: v.detach().clone() for k, v in run.full().items()}
    run.fabric.save(fmp, {"model": run.model, "optimizer": run.opt, "step": 2})
    plain = MLP()
    res["fmp_inference"] = outcome(lambda: load_module_weights(plain, fmp, entry="model"))
    res["fmp_inference_equal"] = {k: torch.equal(v, saved[k]) for k, v in plain.state_dict().items() if k in saved}
    res["fmp_inference_keys"] = sorted(plain.state_dict())
    res["fmp_saved_keys"] = sorted(saved)
    res["fmp_t_plugin"] = outcome(lambda: t_plugin().fit(TPMLP(total_steps=4), ckpt_path=fmp))
    res["fmp_f_plugin"] = outcome(
        lambda: res.update(fmp_f_plugin_equal=same_as_saved(plugin_load(fmp, full=False), saved)))
    res["fmp_f_tp"] = outcome(lambda: tp_run_load(fmp, full=False))
    # Row: Fabric + FabricDistCheckpointStrategy.
    ftp = os.path.join(d, "ftp")
    run = TPRun(fabric_tp())
    run.train(0, 2)
    run.fabric.save(ftp, run.state(2))
    res["ftp_t_plugin"] = outcome(lambda: t_plugin().fit(TPMLP(total_steps=4), ckpt_path=ftp))
    # Row: stock Fabric DDP (a torch.save file).
    sf = os.path.join(d, "stock_fabric.pt")
    run = StockRun(fabric(FabricDDP(timeout=TIMEOUT)))
    run.fabric.save(sf, run.state(0))
    res["sf_t_mp"] = outcome(lambda: t_mp().fit(MPModel(total_steps=4), ckpt_path=sf))
    # Row: Trainer + DistCheckpointModelParallelStrategy.
    tmp = os.path.join(d, "tmp.ckpt")
    t = t_mp(max_steps=2)
    t.fit(MPModel(total_steps=2))
    t.save_checkpoint(tmp)
    res["tmp_f_plugin"] = outcome(lambda: plugin_load(tmp))
    res["tmp_f_tp"] = outcome(lambda: tp_run_load(tmp))
    # Row: Trainer + DistCheckpointStrategy.
    ttp = os.path.join(d, "ttp.ckpt")
    t = trainer(DistCheckpointStrategy(tensor_parallel_size=1, timeout=TIMEOUT), max_steps=2)
    t.fit(TPMLP(total_steps=2))
    t.save_checkpoint(ttp)
    res["ttp_t_mp"] = outcome(lambda: t_mp().fit(MPModel(total_steps=4), ckpt_path=ttp))
    res["ttp_f_plugin"] = outcome(lambda: plugin_load(ttp))
    # Row: Trainer, stock DDP + DistCheckpointIO (a directory), column F+TP.
    tpl = os.path.join(d, "tplugin")
    t = t_plugin()
    t.fit(TPMLP(total_steps=2))
    t.save_checkpoint(tpl)
    stored = DistCheckpointIO().load_checkpoint(tpl)

    def tpl_f_tp() -> None:
        run = TPRun(fabric_tp())
        run.fabric.load(tpl, {"model": run.model, "optimizer": run.opt})
        res["tpl_f_tp_equal"] = {n: torch.equal(p.detach(), stored["state_dict"][n])
                                 for n, p in run.model.module.named_parameters()}
    res["tpl_f_tp"] = outcome(tpl_f_tp)
    # Row: Trainer + Lightning's own ModelParallelStrategy (a DCP directory).
    from lightning.pytorch.strategies import ModelParallelStrategy
    dcp = os.path.join(d, "lightning_dcp")
    t = trainer(ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1, timeout=TIMEOUT), max_steps=2)
    t.fit(MPModel(total_steps=2))
    t.save_checkpoint(dcp)
    res["dcp_t_mp"] = outcome(lambda: t_mp().fit(MPModel(total_steps=4), ckpt_path=dcp))
    res["dcp_f_tp"] = outcome(lambda: tp_run_load(dcp, full=False))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("scenarios", nargs="+")
    p.add_argument("--dir", required=True)
    p.add_argument("--out", required=True)
    run_scenarios({"all": all_cells}, p.parse_args())


if __name__ == "__main__":
    main()
