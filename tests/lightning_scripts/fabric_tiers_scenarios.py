"""Fabric loops with checkpoint tiers for tests/tiers/test_lightning_tiers_fabric.py:
``python fabric_tiers_scenarios.py recovery --dir D --out O --devices 4 --tp 2 --ranks-per-node 2``.

2 simulated nodes of 2 ranks, local saves every 2 steps (FabricTiers), a durable fabric.save at step
6. A run ends at step 9, node 0's local tier is deleted, a new model / optimizer / tier (the
"restart") restores with FabricTiers.restore and trains to 10; then with every local copy gone.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from typing import Any, Dict

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from lightning.fabric import Fabric  # noqa: E402

from lightning_distckpt.lightning import FabricDistCheckpointStrategy  # noqa: E402
from lightning_distckpt.lightning.fabric_tiers import FabricTiers  # noqa: E402
from fabric_scenarios import TIMEOUT, Run  # noqa: E402
from scenario_runner import scenario_main  # noqa: E402

TOTAL, FAIL_AT, DURABLE_AT = 10, 9, 6


def train(run: Run, tiers: FabricTiers, state: Dict[str, Any], durable: str, stop: int) -> None:
    """Steps state["step"] .. stop - 1, a local save when due, the durable save at step 6."""
    for step in range(state["step"], stop):
        run.train(step, step + 1)
        state["step"] = step + 1
        tiers.save(state, step + 1)
        if step + 1 == DURABLE_AT:
            run.fabric.save(durable, state)
    tiers.wait()


def same(a: Run, b: Run) -> bool:
    fa, fb = a.full(), b.full()
    exact = set(fa) == set(fb) and all(torch.equal(fa[k], fb[k]) for k in fa)
    return exact and a.sched.state_dict() == b.sched.state_dict()


def recovery(args: argparse.Namespace, res: Dict[str, Any]) -> None:
    local = os.path.join(args.dir, "local")
    tiers_cfg = {"local_dir": os.path.join(local, "{node}"), "local_every_n_steps": 2,
                 "ranks_per_node": args.ranks_per_node, "replicas": 1, "keep_local": 2}
    strategy = FabricDistCheckpointStrategy(tensor_parallel_size=args.tp, timeout=TIMEOUT,
                                            checkpoint={"tiers": tiers_cfg})
    fabric = Fabric(accelerator="cpu", devices=args.devices, strategy=strategy)
    fabric.launch()
    rank = dist.get_rank()
    a = Run(fabric)
    a.train(0, TOTAL)
    durable = os.path.join(args.dir, "durable_step6")

    b = Run(fabric)
    state = b.state(0)
    tiers = FabricTiers(fabric)
    res["b_restored"] = tiers.restore(state) is None  # nothing saved yet
    train(b, tiers, state, durable, FAIL_AT)

    def restart(lost: Any) -> Dict[str, Any]:
        if rank == 0:
            for node in lost:
                shutil.rmtree(os.path.join(local, node), ignore_errors=True)
        dist.barrier()
        run = Run(fabric)
        state = run.state(0)
        tiers = FabricTiers(fabric)
        point = tiers.restore(state, durable=[(DURABLE_AT, durable)])
        out = {"point": [point.step, point.source], "step": state["step"]}
        train(run, tiers, state, durable + "_again", TOTAL)
        out["exact"] = same(a, run)
        out["losses_match"] = {k: v for k, v in a.losses.items() if k >= out["step"]} == run.losses
        return out

    res["one_node_lost"] = restart(["node0"])
    res["all_local_lost"] = restart(["node0", "node1"])


def model_parallel(args: argparse.Namespace, res: Dict[str, Any]) -> None:
    """As :func:`recovery`, under FabricDistCheckpointModelParallelStrategy (FSDP2 x TP, DTensor state)."""
    from datetime import timedelta

    from fabric_model_parallel_scenarios import Run as MPRun, parallelize

    from lightning_distckpt.lightning.fabric_model_parallel import FabricDistCheckpointModelParallelStrategy

    local = os.path.join(args.dir, "local")
    tiers_cfg = {"local_dir": os.path.join(local, "{node}"), "local_every_n_steps": 2,
                 "ranks_per_node": args.ranks_per_node, "replicas": 1, "keep_local": 2}
    strategy = FabricDistCheckpointModelParallelStrategy(
        parallelize, data_parallel_size=args.devices // args.tp, tensor_parallel_size=args.tp,
        timeout=timedelta(seconds=90), checkpoint={"tiers": tiers_cfg})
    fabric = Fabric(accelerator="cpu", devices=args.devices, strategy=strategy)
    fabric.launch()
    rank = dist.get_rank()
    a = MPRun(fabric)
    a.train(0, TOTAL)
    durable = os.path.join(args.dir, "durable_step6")

    def run_to(run: Any, tiers: FabricTiers, state: Dict[str, Any], stop: int) -> None:
        for step in range(state["step"], stop):
            run.train(step, step + 1)
            state["step"] = step + 1
            tiers.save(state, step + 1)
            if step + 1 == DURABLE_AT:
                fabric.save(durable, state)
        tiers.wait()

    b = MPRun(fabric)
    state = {"model": b.model, "optimizer": b.opt, "step": 0}
    tiers = FabricTiers(fabric)
    res["b_restored"] = tiers.restore(state) is None
    run_to(b, tiers, state, FAIL_AT)

    def restart(lost: Any) -> Dict[str, Any]:
        if rank == 0:
            for node in lost:
                shutil.rmtree(os.path.join(local, node), ignore_errors=True)
        dist.barrier()
        run = MPRun(fabric)
        state = {"model": run.model, "optimizer": run.opt, "step": 0}
        tiers = FabricTiers(fabric)
        point = tiers.restore(state, durable=[(DURABLE_AT, durable)])
        out = {"point": [point.step, point.source], "step": state["step"]}
        run_to(run, tiers, state, TOTAL)
        fa, fr = a.full(), run.full()
        out["exact"] = set(fa) == set(fr) and all(torch.equal(fa[k], fr[k]) for k in fa)
        return out

    res["one_node_lost"] = restart(["node0"])
    res["all_local_lost"] = restart(["node0", "node1"])


if __name__ == "__main__":
    scenario_main({"recovery": recovery, "model_parallel": model_parallel},
                  **{"--ranks-per-node": dict(type=int, default=2)})
