"""Train a tensor-parallel GPT with the Lightning Trainer, checkpoint it, resume it under other splits.

One command runs everything (CPU, gloo; about 30 seconds on 2 cores, mostly process start-up)::

    python examples/train_gpt_tp.py [--dir DIR]

1. trains 12 steps on 2 processes (TP 2), a distributed checkpoint every 4 steps;
2. resumes the step-8 checkpoint on 1 process (TP 1): the TP shards are put together;
3. resumes it on 4 processes (TP 2 x DP 2): the same shards, now replicated over 2 DP ranks;
4. loads it in this process for inference (``load_lightning_module``);

and prints what happened: the checkpoint's layout and the loss of every step in every run, which
must agree (up to float rounding between TP sizes). Each phase is this script again with
``--phase``; Lightning's launcher starts the other ranks of a phase.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

STEPS, EVERY, RESUME_STEP = 12, 4, 8
TOLERANCE = 1e-4  # relative; TP 1 and TP 2 sum in different orders


class _Logs(logging.Handler):
    """Collects the library's save/load throughput lines."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: List[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.name == "lightning_distckpt.saving.stats":  # one line per save or load (rank 0's)
            self.lines.append(record.getMessage())


def run_phase(args: argparse.Namespace) -> None:
    """One Trainer run (this process is one rank of it)."""
    import torch
    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_distckpt.lightning import DistCheckpointStrategy
    from tiny_gpt import TinyGPT

    torch.set_num_threads(1)
    logs = _Logs()
    logging.getLogger("lightning_distckpt").addHandler(logs)
    logging.getLogger("lightning_distckpt").setLevel(logging.INFO)
    ckdir = os.path.join(args.dir, "checkpoints")
    callbacks = []
    if args.phase == "train":
        callbacks.append(ModelCheckpoint(dirpath=ckdir, filename="{step}", every_n_train_steps=EVERY, save_top_k=-1,
                                         save_last=True))
    trainer = Trainer(accelerator="cpu", devices=args.devices, max_steps=STEPS, max_epochs=-1,
                      strategy=DistCheckpointStrategy(tensor_parallel_size=args.tp), callbacks=callbacks,
                      enable_checkpointing=bool(callbacks), logger=False, enable_progress_bar=False,
                      enable_model_summary=False)
    model = TinyGPT(total_steps=STEPS)
    t0 = time.perf_counter()
    trainer.fit(model, ckpt_path=args.ckpt)
    if trainer.is_global_zero:
        out = {"losses": model.losses, "parallel": model.ps.describe(), "seconds": time.perf_counter() - t0,
               "io": logs.lines}
        with open(os.path.join(args.dir, f"{args.name}.json"), "w") as f:
            json.dump(out, f)
    shutdown()


def shutdown() -> None:
    """Leave the process group together, so no rank exits while another still talks to it."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def describe_checkpoint(path: str) -> List[str]:
    """A few lines on what the checkpoint holds and who wrote it."""
    from lightning_distckpt.reading.checkpoint import OpenedCheckpoint

    ckpt = OpenedCheckpoint.open(path)
    lines = [f"{os.path.basename(path)}: saved by {ckpt.meta['world_size']} processes, "
             f"{len(ckpt.index.tensors)} tensors, layout {ckpt.options.layout}"]
    for rank_dir in sorted(os.listdir(os.path.join(path, "data"))):
        full = os.path.join(path, "data", rank_dir)
        size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(full) for f in fs)
        lines.append(f"  data/{rank_dir}: {size / 1024:.0f} KiB")
    for key in ("gpt.blocks.0.fc1.weight", "gpt.blocks.0.fc2.weight", "gpt.tok.weight",
                "optimizer_states.0.state.exp_avg.gpt.blocks.0.fc1.weight"):
        entry = ckpt.index.tensors.get(key)
        if entry is None:
            continue
        shards = ", ".join(f"{tuple(s.shape)}@{tuple(s.offset)} by rank {s.writer}" for s in entry.shards)
        lines.append(f"  {key}: global {tuple(entry.global_shape)} stored as {shards}")
    return lines


def drive(args: argparse.Namespace) -> int:
    """Run the phases one after another and report."""
    os.makedirs(args.dir, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for var in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "GLOBAL_RANK"):
        env.pop(var, None)
    ckpt = os.path.join(args.dir, "checkpoints", f"step={RESUME_STEP}.ckpt")
    phases = [
        ("train", 2, 2, None, f"1. train {STEPS} steps on 2 processes (TP 2), checkpoint every {EVERY} steps"),
        ("resume_tp1", 1, 1, ckpt, f"2. resume step {RESUME_STEP} on 1 process (TP 1)"),
        ("resume_tp2_dp2", 4, 2, ckpt, f"3. resume step {RESUME_STEP} on 4 processes (TP 2 x DP 2)"),
    ]
    runs: Dict[str, Any] = {}
    for name, devices, tp, resume, title in phases:
        print(f"\n== {title}", flush=True)
        cmd = [sys.executable, os.path.abspath(__file__), "--phase", "train" if resume is None else "resume",
               "--name", name, "--dir", args.dir, "--devices", str(devices), "--tp", str(tp)]
        if resume:
            cmd += ["--ckpt", resume]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, env=env, capture_output=not args.verbose, text=True)
        if proc.returncode != 0:
            print(proc.stdout[-3000:] if proc.stdout else "", proc.stderr[-6000:] if proc.stderr else "")
            print(f"phase {name} failed (exit {proc.returncode})")
            return 1
        with open(os.path.join(args.dir, f"{name}.json")) as f:
            runs[name] = json.load(f)
        print(f"   {runs[name]['parallel'].split(': ')[1]} on rank 0; {time.perf_counter() - t0:.1f}s with startup")
        for line in runs[name]["io"]:
            print(f"   {line}")
        if name == "train":
            print("   checkpoints:", " ".join(sorted(os.listdir(os.path.join(args.dir, "checkpoints")))))
            for line in describe_checkpoint(ckpt):
                print(f"   {line}")

    print(f"\n== 4. load step {RESUME_STEP} in this process for inference (load_lightning_module)")
    import torch

    from lightning_distckpt.lightning import load_lightning_module
    from tiny_gpt import TinyGPT

    model = load_lightning_module(TinyGPT, ckpt)
    with torch.no_grad():
        infer_loss = model.loss(model.stream(RESUME_STEP, RESUME_STEP + 1).batch(RESUME_STEP)).item()
    print(f"   {sum(p.numel() for p in model.parameters())} parameters, un-sharded; loss on step {RESUME_STEP}'s "
          f"batch: {infer_loss:.6f}")

    print("\n== losses (global batch) per step")
    names = [p[0] for p in phases]
    print("   step  " + "  ".join(f"{n:>15}" for n in names))
    base = runs["train"]["losses"]
    worst = {n: 0.0 for n in names[1:]}
    for step in range(STEPS):
        cells = []
        for n in names:
            v = runs[n]["losses"].get(str(step))
            cells.append(f"{v:15.6f}" if v is not None else f"{'':>15}")
            if v is not None and n != "train":
                worst[n] = max(worst[n], abs(v - base[str(step)]) / abs(base[str(step)]))
        print(f"   {step:4d}  " + "  ".join(cells))
    checks = {f"{n} continues from the same loss": worst[n] <= TOLERANCE for n in names[1:]}
    checks["resumed runs start at step 8"] = all(min(map(int, runs[n]["losses"])) == RESUME_STEP for n in names[1:])
    infer_diff = abs(infer_loss - base[str(RESUME_STEP)]) / abs(base[str(RESUME_STEP)])
    checks["inference loss matches step 8"] = infer_diff <= TOLERANCE
    print()
    for n in names[1:]:
        print(f"   {n}: largest relative difference from the original run {worst[n]:.2e}")
    print(f"   inference: relative difference {infer_diff:.2e}")
    for what, ok in checks.items():
        print(f"   {'OK  ' if ok else 'FAIL'} {what}")
    summary = {"runs": runs, "worst_relative_diff": worst, "inference_loss": infer_loss, "checks": checks}
    with open(os.path.join(args.dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(f"\nsummary: {os.path.join(args.dir, 'summary.json')}")
    return 0 if all(checks.values()) else 1


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dir", default=None, help="output directory (default: a new temporary directory)")
    p.add_argument("--verbose", action="store_true", help="show the phases' own output")
    p.add_argument("--phase", choices=("train", "resume"), help=argparse.SUPPRESS)
    p.add_argument("--name", help=argparse.SUPPRESS)
    p.add_argument("--devices", type=int, default=2, help=argparse.SUPPRESS)
    p.add_argument("--tp", type=int, default=2, help=argparse.SUPPRESS)
    p.add_argument("--ckpt", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.phase:
        run_phase(args)
        return
    args.dir = os.path.abspath(args.dir or tempfile.mkdtemp(prefix="distckpt_gpt_"))
    print(f"output: {args.dir}")
    sys.exit(drive(args))


if __name__ == "__main__":
    main()
