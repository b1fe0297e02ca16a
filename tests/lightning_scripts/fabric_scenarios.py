"""Real Fabric runs for tests/lightning/test_fabric.py: a custom training loop with fabric.save / fabric.load.

``python fabric_scenarios.py SCENARIO... --dir D --out OUT --devices N --tp T``; the tests start
every rank (``tests/script_ranks.py``), by hand Fabric's launcher re-runs it for the other ranks. Every rank writes ``OUT.rank<r>.json``.
"""

from __future__ import annotations

import argparse
import os
import sys
from datetime import timedelta
from typing import Any, Callable, Dict, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from lightning.fabric import Fabric  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402

from lightning_distckpt import CheckpointingError  # noqa: E402
from lightning_distckpt.lightning import FabricDistCheckpointStrategy  # noqa: E402
from lightning_distckpt.lightning.parallel import ParallelState, module_sharded_state_dict  # noqa: E402
from example_layers import ColumnParallelLinear, RowParallelLinear  # noqa: E402
from lightning_helpers import StepBatches  # noqa: E402
from scenario_runner import scenario_main  # noqa: E402

TIMEOUT = timedelta(seconds=90)


class TPNet(nn.Module):
    """A plain nn.Module with tensor-parallel layers and its sharded_state_dict."""

    def __init__(self, ps: ParallelState, extra_layer: bool = False) -> None:
        super().__init__()
        self.ps = ps
        torch.manual_seed(0)
        self.fc1 = ColumnParallelLinear(8, 16, ps)
        self.fc2 = RowParallelLinear(16, 4, ps)
        self.norm = nn.LayerNorm(4) if extra_layer else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc2(F.gelu(self.fc1(x)))
        return self.norm(y) if self.norm is not None else y

    def sharded_state_dict(self, prefix: str = "") -> Dict[str, Any]:
        return module_sharded_state_dict(self, prefix, replica_id=self.ps.replicated_id)


class Run:
    """Model, optimizer, scheduler set up with Fabric; ``train`` runs steps ``[start, stop)``."""

    def __init__(self, fabric: Fabric, extra_layer: bool = False) -> None:
        self.fabric = fabric
        self.ps: ParallelState = fabric.strategy.parallel_state
        model = TPNet(self.ps, extra_layer)
        opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.01)
        self.sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.7)
        self.model, self.opt = fabric.setup(model, opt)
        self.losses: Dict[int, float] = {}

    def state(self, step: int) -> Dict[str, Any]:
        return {"model": self.model, "optimizer": self.opt, "scheduler": self.sched, "step": step}

    def train(self, start: int, stop: int) -> None:
        data = StepBatches(start, stop, 8, 8, 4, self.ps.dp_rank, self.ps.dp_size)
        for step, (x, y) in zip(range(start, stop), data):
            loss = F.mse_loss(self.model(x), y)
            self.opt.zero_grad()
            self.fabric.backward(loss)
            self.opt.step()
            self.sched.step()
            value = loss.detach().clone()
            if self.ps.dp_size > 1:
                dist.all_reduce(value, group=self.ps.dp_group)
                value /= self.ps.dp_size
            self.losses[step] = value.item()

    def full(self) -> Dict[str, torch.Tensor]:
        """Global weights and optimizer state, gathered over TP (to compare runs)."""
        out = {}
        module = self.model.module
        for name, p in module.named_parameters():
            tensors = {"w": p.detach(), **{k: v for k, v in self.opt.optimizer.state[p].items()}}
            for k, t in tensors.items():
                axis = {"fc1.weight": 0, "fc1.bias": 0, "fc2.weight": 1}.get(name)
                if t.ndim and axis is not None and self.ps.tp_size > 1:
                    parts = [torch.empty_like(t) for _ in range(self.ps.tp_size)]
                    dist.all_gather(parts, t.contiguous(), group=self.ps.tp_group)
                    t = torch.cat(parts, dim=axis)
                out[f"{name}.{k}"] = t.clone()
        return out


def fabric_for(args: argparse.Namespace, **cfg: Any) -> Fabric:
    strategy = FabricDistCheckpointStrategy(tensor_parallel_size=args.tp, timeout=TIMEOUT, checkpoint=cfg or None)
    fabric = Fabric(accelerator="cpu", devices=args.devices, strategy=strategy)
    fabric.launch()
    return fabric


def error_of(fn: Any) -> Optional[str]:
    try:
        fn()
    except (CheckpointingError, KeyError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def exact(args: argparse.Namespace, fabric: Fabric, res: Dict[str, Any]) -> None:
    a = Run(fabric)
    a.train(0, 6)
    path = os.path.join(args.dir, "step3")
    b = Run(fabric)
    b.train(0, 3)
    fabric.save(path, {**b.state(3), "meta": {"note": "hello", "tensor": torch.arange(3)}})
    c = Run(fabric)
    state = c.state(0)
    remainder = fabric.load(path, state)
    res["loaded_step"] = state["step"]
    res["remainder"] = {"note": remainder["meta"]["note"], "tensor": remainder["meta"]["tensor"].tolist()}
    c.train(state["step"], 6)
    fa, fc = a.full(), c.full()
    res["exact_tensors"] = set(fa) == set(fc) and all(torch.equal(fa[k], fc[k]) for k in fa)
    res["exact_sched"] = a.sched.state_dict() == c.sched.state_dict()
    res["losses_a"] = a.losses
    res["losses_c"] = c.losses
    res["checkpoint"] = path
    res["rank_dirs"] = sorted(os.listdir(os.path.join(path, "data")))
    # fabric.load(path) with no state: the whole checkpoint, each tensor whole (TP shards merged).
    whole = fabric.load(path)
    res["whole_shapes"] = {k: list(v.shape) for k, v in whole["model"].items()}
    res["whole_step"] = whole["step"]


def strictness(args: argparse.Namespace, fabric: Fabric, res: Dict[str, Any]) -> None:
    path = os.path.join(args.dir, "step3")
    r = Run(fabric, extra_layer=True)
    res["strict_missing_layer"] = error_of(lambda: fabric.load(path, r.state(0)))
    r = Run(fabric, extra_layer=True)
    norm_before = r.model.module.norm.weight.detach().clone()
    state = r.state(0)
    fabric.load(path, state, strict=False)
    res["nonstrict_step"] = state["step"]
    res["nonstrict_norm_kept"] = torch.equal(r.model.module.norm.weight.detach(), norm_before)
    res["nonstrict_norm_opt_step"] = float(r.opt.optimizer.state[r.model.module.norm.weight]["step"])
    res["nonstrict_fc1_opt_step"] = float(r.opt.optimizer.state[r.model.module.fc1.weight]["step"])
    r.train(3, 5)  # trains on from there
    res["nonstrict_trained"] = sorted(r.losses)
    r = Run(fabric)
    res["strict_missing_entry"] = error_of(lambda: fabric.load(path, {**r.state(0), "not_saved": 1}))
    state = {**r.state(0), "not_saved": 1}
    fabric.load(path, state, strict=False)
    res["nonstrict_missing_entry_kept"] = state["not_saved"]
    # A filtered save keeps only the selected model entries.
    fpath = os.path.join(args.dir, "filtered")
    fabric.save(fpath, r.state(0), filter={"model": lambda k, v: "fc1" in k})
    whole = fabric.load(fpath)
    res["filtered_keys"] = sorted(whole["model"])


def resume(args: argparse.Namespace, fabric: Fabric, res: Dict[str, Any]) -> None:
    r = Run(fabric)
    state = r.state(0)
    fabric.load(args.resume, state)
    r.train(state["step"], 6)
    res["losses"] = r.losses
    res["parallel"] = r.ps.describe()


_FABRIC: Dict[str, Fabric] = {}


def _with_fabric(fn: Callable[[argparse.Namespace, Fabric, Dict[str, Any]], None]) -> Callable[..., None]:
    """A scenario run with this process's one Fabric (made by the first scenario that runs)."""
    def run(args: argparse.Namespace, res: Dict[str, Any]) -> None:
        if "fabric" not in _FABRIC:
            _FABRIC["fabric"] = fabric_for(args)
        fn(args, _FABRIC["fabric"], res)
    return run


SCENARIOS = {name: _with_fabric(fn) for name, fn in {"exact": exact, "strictness": strictness, "resume": resume}.items()}


if __name__ == "__main__":
    scenario_main(SCENARIOS, **{"--resume": {"default": None}})
