"""Fabric runs across checkpoint borders for tests/lightning/test_borders_fabric.py:
``python border_fabric.py SCENARIO... --dir D --out OUT``. Every rank writes ``OUT.rank<r>.json``.

Stock Fabric DDP (TP 1 x DP 2, with or without the DistCheckpointIO plugin) and
FabricDistCheckpointStrategy(tensor_parallel_size=2) run one after the other in the same 2 processes.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from scenario_runner import scenario_main  # noqa: E402
import torch  # noqa: E402
from lightning.fabric import Fabric  # noqa: E402
from lightning.fabric.strategies import DDPStrategy  # noqa: E402

from lightning_distckpt import CheckpointingError, ShardedTensor, save  # noqa: E402
from lightning_distckpt.lightning.tree import KIND_SHARDED, MANIFEST_KEY, manifest  # noqa: E402
from lightning_distckpt.lightning import DistCheckpointIO, FabricDistCheckpointStrategy, ParallelState  # noqa: E402
from lightning_distckpt.lightning.parallel import data_parallel_world  # noqa: E402
from fabric_scenarios import TIMEOUT, Run, TPNet  # noqa: E402
from border_trainer import expected_shard  # noqa: E402


class StockRun(Run):
    """Run under stock Fabric DDP: the TP layers built for TP 1 x DP world."""

    def __init__(self, fabric: Fabric) -> None:  # noqa: D107  (Run's body with the stock parallel state)
        self.fabric = fabric
        self.ps: ParallelState = data_parallel_world()
        model = TPNet(self.ps)
        opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.01)
        self.sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.7)
        self.model, self.opt = fabric.setup(model, opt)
        self.losses: Dict[int, float] = {}


def fabric_with(strategy: Any, plugins: Optional[List[Any]] = None) -> Fabric:
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy, plugins=plugins)
    fabric.launch()
    return fabric


def tp2_fabric() -> Fabric:
    return fabric_with(FabricDistCheckpointStrategy(tensor_parallel_size=2, timeout=TIMEOUT))


def compare_to_stored(run: Run, stored: Dict[str, Any]) -> Dict[str, bool]:
    """Each local weight and optimizer state equals the stored whole tensor sliced for this TP rank."""
    out = {}
    module = run.model.module
    for j, (name, p) in enumerate(module.named_parameters()):
        out[name] = torch.equal(p.detach(), expected_shard(name, stored["model"][name], run.ps.tp_rank, run.ps.tp_size))
        for k, v in run.opt.optimizer.state[p].items():
            want = expected_shard(name, stored["optimizer"]["state"][j][k], run.ps.tp_rank, run.ps.tp_size)
            out[f"{name}.{k}"] = torch.equal(v, want)
    return out


def resume_tp2(source: str, res: Dict[str, Any], tag: str) -> None:
    stored = DistCheckpointIO().load_checkpoint(source)  # a torch.save file or a plugin directory, whole
    run = Run(tp2_fabric())
    state = run.state(0)
    run.fabric.load(source, state)
    res[tag] = {"equal": compare_to_stored(run, stored), "step": state["step"],
                "sched": run.sched.state_dict() == stored["scheduler"]}
    run.train(state["step"], 6)
    res[f"{tag}_losses"] = run.losses


def stock_file(args: argparse.Namespace, res: Dict[str, Any]) -> None:
    """Stock Fabric DDP saves a torch.save file; the TP 2 strategy loads it and trains on."""
    fabric = fabric_with(DDPStrategy(timeout=TIMEOUT))
    ref = StockRun(fabric)
    ref.train(0, 6)
    res["ref_losses"] = ref.losses
    run = StockRun(fabric)
    run.train(0, 3)
    path = os.path.join(args.dir, "stock.ckpt")
    fabric.save(path, run.state(3))
    resume_tp2(path, res, "file")
    # The same file under stock Fabric DDP with the plugin: DistCheckpointIO reads it as it is.
    run = StockRun(fabric_with(DDPStrategy(timeout=TIMEOUT), plugins=[DistCheckpointIO()]))
    state = run.state(0)
    run.fabric.load(path, state)
    stored = DistCheckpointIO().load_checkpoint(path)
    res["file_plugin"] = {"equal": compare_to_stored(run, stored), "step": state["step"]}


def plugin_dir(args: argparse.Namespace, res: Dict[str, Any]) -> None:
    """Defect 2: stock Fabric DDP with the DistCheckpointIO plugin saves a directory; the TP 2 strategy loads it."""
    fabric = fabric_with(DDPStrategy(timeout=TIMEOUT), plugins=[DistCheckpointIO()])
    run = StockRun(fabric)
    run.train(0, 3)
    path = os.path.join(args.dir, "plugin")
    fabric.save(path, run.state(3))
    resume_tp2(path, res, "plugin")


def tp2_whole(args: argparse.Namespace, res: Dict[str, Any]) -> None:
    """Defects 1 and 3: a TP 2 checkpoint read whole has the module's own keys; fabric.load of the
    model alone returns the optimizer's whole state, moments included."""
    fabric = tp2_fabric()
    run = Run(fabric)
    run.train(0, 3)
    path = os.path.join(args.dir, "tp2")
    fabric.save(path, run.state(3))
    whole = DistCheckpointIO().load_checkpoint(path)
    res["whole_model_keys"] = sorted(whole["model"])
    plain = TPNet(ParallelState.single())
    plain.load_state_dict(whole["model"])  # strict: a stock module takes them as they are
    res["whole_loads_strict"] = True
    again = Run(fabric)
    rest = fabric.load(path, {"model": again.model})
    opt_state = rest["optimizer"]["state"]
    res["rest_optimizer_entries"] = {k: sorted(v) for k, v in opt_state.items()}
    res["rest_exp_avg_shape"] = list(opt_state["model.fc1.weight"]["exp_avg"].shape)
    res["rest_step"] = rest["step"]


def no_sharded_state_dict(args: argparse.Namespace, res: Dict[str, Any]) -> None:
    """Defect 5 under Fabric: fabric.setup refuses a module that describes no shard under TP 2."""
    fabric = tp2_fabric()
    try:
        fabric.setup(torch.nn.Sequential(torch.nn.Linear(8, 8)))
        res["no_ssd"] = "no error"
    except CheckpointingError as e:
        res["no_ssd"] = f"{type(e).__name__}: {e}"


def tp2_to_plugin(args: argparse.Namespace, res: Dict[str, Any]) -> None:
    """Border: the TP 2 checkpoint of tp2_whole loaded by stock Fabric DDP with the plugin."""
    path = os.path.join(args.dir, "tp2")
    stored = DistCheckpointIO().load_checkpoint(path)
    run = StockRun(fabric_with(DDPStrategy(timeout=TIMEOUT), plugins=[DistCheckpointIO()]))
    state = run.state(0)
    run.fabric.load(path, state)
    res["to_plugin"] = {"equal": compare_to_stored(run, stored), "step": state["step"],
                        "sched": run.sched.state_dict() == stored["scheduler"]}


def trainer_file(args: argparse.Namespace, res: Dict[str, Any]) -> None:
    """Border: a Trainer's stock .ckpt layout (state_dict, optimizer_states, lr_schedulers, loops) read
    by fabric.load into {"model", "optimizer"} under TP 2; the rest comes back as it was saved."""
    run = StockRun(fabric_with(DDPStrategy(timeout=TIMEOUT)))
    run.train(0, 3)
    path = os.path.join(args.dir, "trainer.ckpt")
    stored = {"model": run.model.module.state_dict(), "optimizer": run.opt.optimizer.state_dict()}
    if torch.distributed.get_rank() == 0:
        torch.save({"state_dict": stored["model"], "optimizer_states": [stored["optimizer"]], "global_step": 3,
                    "epoch": 0, "loops": {"fit_loop": {}}, "lr_schedulers": [run.sched.state_dict()]}, path)
    torch.distributed.barrier()
    tp = Run(tp2_fabric())
    rest = tp.fabric.load(path, {"model": tp.model, "optimizer": tp.opt})
    res["trainer_file"] = {"equal": compare_to_stored(tp, stored), "rest": sorted(rest),
                           "sched": rest["lr_schedulers"][0] == run.sched.state_dict()}


def trainer_checkpoint_refused(args: argparse.Namespace, res: Dict[str, Any]) -> None:
    """Border: a Trainer checkpoint of the TP strategy (sharded) is refused by fabric.load under the
    TP strategy, saying who wrote it and what to do."""
    path = os.path.join(args.dir, "trainer_like")
    fabric = tp2_fabric()
    rank = torch.distributed.get_rank()
    tree: Dict[str, Any] = {"state_dict": {"fc1.weight": ShardedTensor.from_rank_offsets(
        "fc1.weight", torch.zeros(16, 8), replica_id=rank)}, "loops": {}}
    tree[MANIFEST_KEY] = manifest(tree, KIND_SHARDED)
    save(tree, path)
    run = Run(fabric)
    try:
        run.fabric.load(path, run.state(0))
        res["trainer_refused"] = "no error"
    except CheckpointingError as e:
        res["trainer_refused"] = f"{type(e).__name__}: {e}"


SCENARIOS = {"stock_file": stock_file, "plugin_dir": plugin_dir, "tp2_whole": tp2_whole,
             "no_sharded_state_dict": no_sharded_state_dict, "tp2_to_plugin": tp2_to_plugin,
             "trainer_checkpoint_refused": trainer_checkpoint_refused, "trainer_file": trainer_file}


if __name__ == "__main__":
    scenario_main(SCENARIOS)
