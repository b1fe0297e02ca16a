"""Save / load of a Lightning ``ModelParallelStrategy`` (FSDP2) training state: our
``DistCheckpointModelParallelStrategy`` against the stock strategy's DCP path, same model, one run.

    .venv/bin/python benchmarks/bench_model_parallel.py --width 1024 --layers 8 --repeats 5 \\
        --json benchmarks/results/model_parallel_run1.json

Two Trainers (``--devices`` gloo CPU processes, launched by Lightning; FSDP2 over DP = devices /
``--tp``, ``parallelize_module`` over TP) fit the same MLP (``--layers`` Linear(width, width),
AdamW) for one step, so both hold the same weights and Adam moments as DTensors. Then, repeated
``--repeats`` times with the contestants' order rotating:

* save: ``trainer.save_checkpoint(path)`` (the whole Lightning checkpoint: DTensor weights and
  moments sharded, loops / callbacks / hyper-parameters as common state), barrier to barrier;
* load: the page cache of the checkpoint's files dropped, the parameters and moments zeroed, then
  ``trainer.strategy.load_checkpoint(path)`` (what ``fit(ckpt_path=...)`` calls), barrier to barrier;
  every loaded local tensor is checked bit-exact against its value before the save.

``ours_async`` is our strategy with ``checkpoint={"async_save": True}``: its "save" is the part that
blocks training (planning and the snapshot into staging buffers), "save to commit" adds the
background writes and the commit (``checkpoint_io.wait()``), which the stock strategy cannot overlap.
Both synchronous saves are durable (ours fsyncs by default, DCP's FileSystemWriter has
``sync_files=True``). Medians are reported; the machine's load average before and after is recorded.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any, Dict, List

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import dir_bytes, drop_page_cache, fmt_table, machine_summary  # noqa: E402
from lightning.pytorch import LightningModule, Trainer  # noqa: E402
from lightning.pytorch.strategies import ModelParallelStrategy  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module  # noqa: E402

from lightning_distckpt.lightning import DistCheckpointModelParallelStrategy  # noqa: E402

CONTESTANTS = ("ours", "stock_dcp", "ours_async")


class MLP(LightningModule):
    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(layers))

    def configure_model(self) -> None:
        tp, dp = self.device_mesh["tensor_parallel"], self.device_mesh["data_parallel"]
        if tp.size() > 1:  # pairs of layers: column- then row-parallel
            plan = {f"layers.{i}": ColwiseParallel() if i % 2 == 0 else RowwiseParallel()
                    for i in range(len(self.layers))}
            parallelize_module(self, tp, plan)
        for layer in [*self.layers, self]:
            fully_shard(layer, mesh=dp)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        x = batch
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x.pow(2).mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> Any:
        data = torch.randn(8, self.hparams.width, generator=torch.Generator().manual_seed(0))
        return torch.utils.data.DataLoader(data, batch_size=4)


def _local_tensors(trainer: Trainer) -> List[torch.Tensor]:
    """Every parameter's and Adam moment's local shard on this rank."""
    out = []
    opt = trainer.optimizers[0]
    for p in trainer.lightning_module.parameters():
        out.append(p)
        out += [v for k, v in sorted(opt.state[p].items()) if k != "step"]
    return [t.to_local() if isinstance(t, DTensor) else t for t in out]


def _barrier_timed(fn: Any) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0


def _one(trainer: Trainer, path: str) -> Dict[str, Any]:
    """Save, drop the page cache, zero the state, load; returns the times and whether it is exact."""
    before = [t.detach().clone() for t in _local_tensors(trainer)]
    save_s = _barrier_timed(lambda: trainer.save_checkpoint(path))
    commit_s = 0.0
    if isinstance(trainer.strategy, DistCheckpointModelParallelStrategy) and trainer.strategy.checkpoint_io.pending:
        commit_s = _barrier_timed(trainer.strategy.checkpoint_io.wait)  # the background writes and the commit
    nbytes = dir_bytes(path)
    drop_page_cache(path)
    with torch.no_grad():
        for t in _local_tensors(trainer):
            t.zero_()
    load_s = _barrier_timed(lambda: trainer.strategy.load_checkpoint(path, weights_only=True))
    exact = all(torch.equal(a, b) for a, b in zip(before, _local_tensors(trainer)))
    flags = [None] * dist.get_world_size()
    dist.all_gather_object(flags, exact)
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(path)
    return {"save_s": save_s, "total_save_s": save_s + commit_s, "load_s": load_s, "bytes": nbytes,
            "exact": all(flags)}


def _trainer(strategy: Any, devices: int) -> Trainer:
    return Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=1, logger=False,
                   enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (DP = devices / tp)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--dir", default=None, help="where checkpoints are written (default: a temp dir in the cwd)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    torch.set_num_threads(1)
    load_before = os.getloadavg()
    dp = args.devices // args.tp
    trainers = {
        "ours": _trainer(DistCheckpointModelParallelStrategy(data_parallel_size=dp, tensor_parallel_size=args.tp),
                         args.devices),
        "stock_dcp": _trainer(ModelParallelStrategy(data_parallel_size=dp, tensor_parallel_size=args.tp), args.devices),
        "ours_async": _trainer(DistCheckpointModelParallelStrategy(
            data_parallel_size=dp, tensor_parallel_size=args.tp, checkpoint={"async_save": True}), args.devices),
    }
    for t in trainers.values():
        t.fit(MLP(args.width, args.layers))
    root = args.dir or "."
    workdir = dist_broadcast_str(tempfile.mkdtemp(prefix="bench_mp_", dir=root) if dist.get_rank() == 0 else "")
    runs: List[Dict[str, Any]] = []
    for r in range(args.repeats):
        order = CONTESTANTS[r % 3:] + CONTESTANTS[:r % 3]  # each contestant first in turn
        for name in order:
            res = _one(trainers[name], os.path.join(workdir, f"{name}-{r}"))
            runs.append({"contestant": name, "repeat": r, **res})
    load_after = os.getloadavg()
    if dist.get_rank() == 0:
        shutil.rmtree(workdir, ignore_errors=True)
        report(args, runs, load_before, load_after)
    dist.barrier()
    dist.destroy_process_group()


def dist_broadcast_str(value: str) -> str:
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def report(args: argparse.Namespace, runs: List[Dict[str, Any]], load_before: Any, load_after: Any) -> None:
    summary = {}
    for name in CONTESTANTS:
        mine = [x for x in runs if x["contestant"] == name]
        summary[name] = {"save_s": statistics.median(x["save_s"] for x in mine),
                         "total_save_s": statistics.median(x["total_save_s"] for x in mine),
                         "load_s": statistics.median(x["load_s"] for x in mine),
                         "bytes": mine[0]["bytes"], "exact": all(x["exact"] for x in mine)}
    ratio = {k: summary["stock_dcp"][k] / summary["ours"][k] for k in ("save_s", "load_s")}
    ratio["async_blocking"] = summary["stock_dcp"]["save_s"] / summary["ours_async"]["save_s"]
    rows = [[n, f"{s['save_s']:.3f}", f"{s['total_save_s']:.3f}", f"{s['load_s']:.3f}", f"{s['bytes'] / 2**20:.1f}",
             s["exact"]] for n, s in summary.items()]
    print(fmt_table(["contestant", "save blocks s (median)", "save to commit s", "load s (median)", "MiB on disk",
                     "loads exact"], rows))
    print(f"stock DCP time / ours: save {ratio['save_s']:.2f}x, load {ratio['load_s']:.2f}x, "
          f"async save's blocking part {ratio['async_blocking']:.2f}x; "
          f"loadavg before {load_before}, after {load_after}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": " ".join([os.path.basename(sys.executable), *sys.argv]), "machine": machine_summary(),
                       "date": datetime.datetime.now().isoformat(timespec="seconds"), "args": vars(args),
                       "loadavg_before": load_before, "loadavg_after": load_after, "runs": runs,
                       "summary": summary, "stock_over_ours": ratio}, f, indent=1)


if __name__ == "__main__":
    main()
