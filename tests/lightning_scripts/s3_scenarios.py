"""Trainer and Fabric on ``s3://`` checkpoints for tests/s3/test_s3_lightning.py (2 processes, TP 2):
``python s3_scenarios.py trainer|fabric --dir s3://bucket/prefix --out OUT``. The AWS environment
(endpoint, keys) comes from the test. Every rank writes ``OUT.rank<r>.json``."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Dict

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # tests/ (lightning_helpers)

from scenario_runner import scenario_main  # noqa: E402
import torch  # noqa: E402

from lightning_distckpt.lightning import DistCheckpointStrategy  # noqa: E402
from lightning_distckpt.lightning.model_checkpoint import DistModelCheckpoint  # noqa: E402
from lightning_distckpt.storage.s3_versions import committed_children  # noqa: E402
from lightning_helpers import TPMLP, StepCounter  # noqa: E402
from border_trainer import RestoredState, stored_of  # noqa: E402
from fabric_scenarios import Run, fabric_for  # noqa: E402
from trainer_scenarios import TIMEOUT, trainer  # noqa: E402


def _callback(ckdir: str) -> DistModelCheckpoint:
    return DistModelCheckpoint(dirpath=ckdir, filename="{step}", monitor="train_loss", save_top_k=2,
                               every_n_train_steps=1, save_last=True)


def trainer_topk_last(args: argparse.Namespace, res: Dict[str, Any]) -> None:
    """4 steps with top-2 and last on s3://, then resume from ckpt_path="last" to step 6."""
    ckdir = f"{args.dir}/ckpts"
    cb = _callback(ckdir)
    t = trainer(args, DistCheckpointStrategy(tensor_parallel_size=2, timeout=TIMEOUT), 4, [cb, StepCounter()])
    t.fit(TPMLP(total_steps=8))
    res["listing"] = [url.rsplit("/", 1)[1] for url in committed_children(ckdir)]
    res["best"] = sorted(os.path.basename(p) for p in cb.best_k_models)
    stored = stored_of(f"{ckdir}/last.ckpt")  # read alone by each rank (DistCheckpointIO.load_checkpoint)
    model = TPMLP(total_steps=8)
    t2 = trainer(args, DistCheckpointStrategy(tensor_parallel_size=2, timeout=TIMEOUT), 6,
                 [_callback(ckdir), StepCounter(), RestoredState(stored, res, "restored")])
    t2.fit(model, ckpt_path="last")
    res["resumed_from"] = str(t2.ckpt_path)
    res["first_step"] = min(model.losses)
    res["listing_after"] = [url.rsplit("/", 1)[1] for url in committed_children(ckdir)]


def fabric_save_load(args: argparse.Namespace, res: Dict[str, Any]) -> None:
    """fabric.save to s3:// after 3 steps; a fresh run loads it (resharded nowhere: TP 2 both)."""
    args.tp = 2
    fabric = fabric_for(args)
    path = f"{args.dir}/fabric/step3"
    b = Run(fabric)
    b.train(0, 3)
    fabric.save(path, {**b.state(3), "meta": {"note": "hello"}})
    c = Run(fabric)
    state = c.state(0)
    remainder = fabric.load(path, state)
    fb, fc = b.full(), c.full()
    res["loaded_step"] = state["step"]
    res["remainder"] = remainder["meta"]["note"]
    res["exact"] = set(fb) == set(fc) and all(torch.equal(fb[k], fc[k]) for k in fb)
    whole = fabric.load(path)  # no state: every tensor whole
    res["whole_shapes"] = {k: list(v.shape) for k, v in whole["model"].items()}


SCENARIOS = {"trainer": trainer_topk_last, "fabric": fabric_save_load}


if __name__ == "__main__":
    scenario_main(SCENARIOS)
