"""Fabric runs of ``FabricDistCheckpointModelParallelStrategy`` (FSDP2 / tensor parallel, CPU gloo) for
tests/lightning/test_model_parallel_fabric.py: ``python fabric_model_parallel_scenarios.py SCENARIO --dir D --out O``.
The tests start every rank (``tests/script_ranks.py``); by hand, Fabric's launcher re-runs it. Every rank
writes ``OUT.rank<r>.json``."""

from __future__ import annotations

import argparse
import os
import sys
from datetime import timedelta
from typing import Any, Dict

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # tests/ (lightning_helpers)

from scenario_runner import scenario_main  # noqa: E402
import torch  # noqa: E402
from lightning.fabric import Fabric  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module  # noqa: E402
from torch.nn import functional as F  # noqa: E402

from lightning_distckpt import CheckpointingError  # noqa: E402
from lightning_distckpt.lightning.fabric_model_parallel import FabricDistCheckpointModelParallelStrategy  # noqa: E402
from lightning_helpers import SmallMLP as MLP  # noqa: E402
from lightning_helpers import StepBatches  # noqa: E402


def parallelize(model: MLP, mesh: Any) -> MLP:
    tp, dp = mesh["tensor_parallel"], mesh["data_parallel"]
    if tp.size() > 1:
        parallelize_module(model, tp, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    for layer in (model.fc1, model.fc2, model):
        fully_shard(layer, mesh=dp)
    return model


class Run:
    def __init__(self, fabric: Fabric) -> None:
        self.fabric = fabric
        self.model = fabric.setup_module(MLP())
        self.opt = fabric.setup_optimizers(torch.optim.AdamW(self.model.parameters(), lr=0.05, weight_decay=0.01))
        dp = fabric.strategy.device_mesh["data_parallel"]
        self.batches = StepBatches(0, 6, 8, 8, 4, dp.get_local_rank(), dp.size())

    def train(self, start: int, stop: int) -> None:
        for step in range(start, stop):
            x, y = self.batches.batch(step)
            self.fabric.backward(F.mse_loss(self.model(x), y))
            self.opt.step()
            self.opt.zero_grad()

    def full(self) -> Dict[str, torch.Tensor]:
        out = {}
        for name, p in self.model.module.named_parameters():
            out[name] = _full(p)
            for k, v in sorted(self.opt.state[p].items()):
                out[f"{name}.{k}"] = _full(v)
        return out


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _expected(stored: Dict[str, Any], names: Any) -> Dict[str, torch.Tensor]:
    """The stored checkpoint read whole (optimizer in torch's layout, by index) by parameter name."""
    out = {}
    for j, name in enumerate(names):
        out[name] = stored["model"][name]
        for k, v in stored["optimizer"]["state"][j].items():
            out[f"{name}.{k}"] = v if isinstance(v, torch.Tensor) else torch.tensor(v)
    return out


def _same(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor]) -> Dict[str, bool]:
    return {k: k in b and torch.equal(a[k].to(b[k].dtype), b[k]) for k in a}


def fabric_for(args: argparse.Namespace) -> Fabric:
    strategy = FabricDistCheckpointModelParallelStrategy(parallelize, data_parallel_size=args.devices // args.tp,
                                                         tensor_parallel_size=args.tp, timeout=timedelta(seconds=90))
    fabric = Fabric(accelerator="cpu", devices=args.devices, strategy=strategy)
    fabric.launch()
    return fabric


def exact(args: argparse.Namespace, res: Dict[str, Any]) -> None:
    """Save at step 3 and go on to 6; a fresh run loads step 3 and goes on to 6: bit-exact."""
    fabric = fabric_for(args)
    path = os.path.join(args.dir, "step3")
    ref = Run(fabric)
    ref.train(0, 3)
    fabric.save(path, {"model": ref.model, "optimizer": ref.opt, "step": 3})
    ref.train(3, 6)
    resumed = Run(fabric)
    state = {"model": resumed.model, "optimizer": resumed.opt, "step": 0}
    rest = fabric.load(path, state)
    stored = fabric.load(path)  # no state: the whole checkpoint
    res["restored"] = _same(_expected(stored, [n for n, _ in resumed.model.module.named_parameters()]), resumed.full())
    res["step"], res["rest"] = state["step"], sorted(rest)
    resumed.train(3, 6)
    res["final"] = _same(ref.full(), resumed.full())
    other = Run(fabric)  # only the module asked for: the optimizer comes back whole, moments included
    rest = fabric.load(path, {"model": other.model})
    res["unasked_optimizer"] = sorted(k for s in rest["optimizer"]["state"].values() for k in s)
    try:
        fabric.load(os.path.join(args.dir, "nothing_here"), {"model": other.model})
        res["missing"] = "no error"
    except CheckpointingError as e:
        res["missing"] = f"{type(e).__name__}: {e}"


def other_split(args: argparse.Namespace, res: Dict[str, Any]) -> None:
    """The DP 2 checkpoint under this run's mesh (TP = args.tp)."""
    fabric = fabric_for(args)
    path = os.path.join(args.dir, "step3")
    run = Run(fabric)
    state = {"model": run.model, "optimizer": run.opt, "step": 0}
    fabric.load(path, state)
    stored = fabric.load(path)
    res["restored"] = _same(_expected(stored, [n for n, _ in run.model.module.named_parameters()]), run.full())
    res["step"] = state["step"]


SCENARIOS = {"exact": exact, "other_split": other_split}


if __name__ == "__main__":
    scenario_main(SCENARIOS)
