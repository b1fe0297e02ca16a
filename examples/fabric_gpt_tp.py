"""The tensor-parallel GPT in a Fabric custom training loop, with distributed checkpoints.

One command::

    python examples/fabric_gpt_tp.py [--dir DIR]

trains 12 steps on 2 processes (TP 2) with ``fabric.save`` every 4 steps, then resumes the step-8
checkpoint with ``fabric.load`` on 1 process (TP 1) and on 4 processes (TP 2 x DP 2), and prints
the loss of every step of every run (they agree up to float rounding between TP sizes).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from typing import Any, Dict

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

STEPS, EVERY, RESUME_STEP = 12, 4, 8
HP = dict(vocab=64, seq_len=32, d_model=64, n_heads=4, n_layers=2, global_batch=8, seed=0)


def run_phase(args: argparse.Namespace) -> None:
    """A custom training loop (this process is one rank of it)."""
    import torch
    import torch.distributed as dist
    from lightning.fabric import Fabric
    from torch.nn import functional as F

    from lightning_distckpt.lightning import FabricDistCheckpointStrategy
    from tiny_gpt import GPT, TokenStream

    torch.set_num_threads(1)
    fabric = Fabric(accelerator="cpu", devices=args.devices,
                    strategy=FabricDistCheckpointStrategy(tensor_parallel_size=args.tp))
    fabric.launch()
    ps = fabric.strategy.parallel_state  # this rank's TP x DP place and groups
    torch.manual_seed(HP["seed"])
    model = GPT(HP["vocab"], HP["seq_len"], HP["d_model"], HP["n_heads"], HP["n_layers"], ps)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=STEPS)
    model, optimizer = fabric.setup(model, optimizer)
    state: Dict[str, Any] = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "step": 0}
    if args.ckpt:
        fabric.load(args.ckpt, state)  # collective; reshards to this split; updates state["step"]
    data = TokenStream(HP["vocab"], HP["seq_len"], HP["global_batch"], state["step"], STEPS, ps.dp_rank, ps.dp_size,
                       HP["seed"])
    losses: Dict[int, float] = {}
    for inp, target in data:
        loss = F.cross_entropy(model(inp).flatten(0, 1), target.flatten())
        optimizer.zero_grad()
        fabric.backward(loss)
        optimizer.step()
        scheduler.step()
        value = loss.detach().clone()
        if ps.dp_size > 1:
            dist.all_reduce(value, group=ps.dp_group)
            value /= ps.dp_size
        losses[state["step"]] = value.item()
        state["step"] += 1
        if args.save and state["step"] % EVERY == 0:
            fabric.save(os.path.join(args.dir, "checkpoints", f"step={state['step']}"), state)
    if fabric.global_rank == 0:
        with open(os.path.join(args.dir, f"{args.name}.json"), "w") as f:
            json.dump({"losses": losses, "parallel": ps.describe()}, f)
    fabric.barrier()
    dist.destroy_process_group()  # leave together: no rank exits while another still talks to it


def drive(args: argparse.Namespace) -> int:
    os.makedirs(args.dir, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for var in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "GLOBAL_RANK"):
        env.pop(var, None)
    ckpt = os.path.join(args.dir, "checkpoints", f"step={RESUME_STEP}")
    phases = [("train", 2, 2, None), ("resume_tp1", 1, 1, ckpt), ("resume_tp2_dp2", 4, 2, ckpt)]
    runs: Dict[str, Any] = {}
    for name, devices, tp, resume in phases:
        print(f"== {name}: {devices} processes, TP {tp} x DP {devices // tp}" + (f", from {resume}" if resume else ""),
              flush=True)
        cmd = [sys.executable, os.path.abspath(__file__), "--phase", "--name", name, "--dir", args.dir,
               "--devices", str(devices), "--tp", str(tp)]
        cmd += ["--ckpt", resume] if resume else ["--save"]
        proc = subprocess.run(cmd, env=env, capture_output=not args.verbose, text=True)
        if proc.returncode != 0:
            print(proc.stdout[-3000:] if proc.stdout else "", proc.stderr[-6000:] if proc.stderr else "")
            return 1
        with open(os.path.join(args.dir, f"{name}.json")) as f:
            runs[name] = json.load(f)
    print("   checkpoints:", " ".join(sorted(os.listdir(os.path.join(args.dir, "checkpoints")))))
    base = runs["train"]["losses"]
    worst = {}
    print("   step  " + "  ".join(f"{n:>15}" for n, *_ in phases))
    for step in range(STEPS):
        row = [runs[n]["losses"].get(str(step)) for n, *_ in phases]
        print(f"   {step:4d}  " + "  ".join(f"{v:15.6f}" if v is not None else " " * 15 for v in row))
    for name, *_ in phases[1:]:
        worst[name] = max(abs(v - base[s]) / abs(base[s]) for s, v in runs[name]["losses"].items())
        print(f"   {name}: largest relative difference from the original run {worst[name]:.2e}")
    ok = all(w <= 1e-4 for w in worst.values()) and all(
        min(map(int, runs[n]["losses"])) == RESUME_STEP for n, *_ in phases[1:])
    with open(os.path.join(args.dir, "summary.json"), "w") as f:
        json.dump({"runs": runs, "worst_relative_diff": worst, "ok": ok}, f, indent=1)
    print("OK" if ok else "FAIL")
    return 0 if ok else 1


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dir", default=None, help="output directory (default: a new temporary directory)")
    p.add_argument("--verbose", action="store_true", help="show the phases' own output")
    p.add_argument("--phase", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--name", help=argparse.SUPPRESS)
    p.add_argument("--devices", type=int, default=2, help=argparse.SUPPRESS)
    p.add_argument("--tp", type=int, default=2, help=argparse.SUPPRESS)
    p.add_argument("--ckpt", default=None, help=argparse.SUPPRESS)
    p.add_argument("--save", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.phase:
        run_phase(args)
        return
    args.dir = os.path.abspath(args.dir or tempfile.mkdtemp(prefix="distckpt_fabric_"))
    print(f"output: {args.dir}")
    sys.exit(drive(args))


if __name__ == "__main__":
    main()
