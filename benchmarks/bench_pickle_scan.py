"""Cost of the pickle pre-scan (storage/pickle_scan.py) that every load of a ``common.pt``, a ShardedObject
and a torch file runs before torch unpickles it, against the scanner of another tree, interleaved.

    .venv/bin/python benchmarks/bench_pickle_scan.py --ab /tmp/before --repeats 30 [--json out.json]

Pickles (the ``data.pkl`` of a ``torch.save`` archive, as the scan reads it): a Lightning-like common
state (hyper-parameters, loops, callbacks, optimizer param_groups and scheduler state, ~140 KB), and a
hyper-parameter set held in omegaconf DictConfigs (~1.6 MB: every node a pickled object with its
metadata). Each case is timed for ``check_pickle_bytes`` (the in-memory scan) and ``check_pickle`` (the
stream scan of the pre-1.6 format), before and after alternating within each repeat; a full safe load
(``torch.load(weights_only=True)``, the scan and the loaded tree's walk) of the archive, timed fewer
times, gives the share. Prints medians and minimums (ms) and the speed-up of the medians.
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import json
import os
import platform
import statistics
import sys
import time
import zipfile
from typing import Any, Callable, Dict, List

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def lightning_common(groups: int = 8, params: int = 4000) -> Dict[str, Any]:
    """What Lightning puts in a checkpoint beside the weights (the optimizer's per-parameter state is
    sharded; its param_groups are not)."""
    progress = {"total": {"ready": 1000, "completed": 1000, "started": 1000, "processed": 1000},
                "current": {"ready": 10, "completed": 10, "started": 10, "processed": 10}}
    loop = {"state_dict": {"_batches_that_stepped": 1000}, "epoch_loop.state_dict": {"_batches_that_stepped": 1000},
            "epoch_loop.batch_progress": {**progress, "is_last_batch": False},
            "epoch_loop.scheduler_progress": progress,
            "epoch_loop.automatic_optimization.optim_progress": {
                "optimizer": {"step": progress, "zero_grad": progress}},
            "epoch_loop.manual_optimization.optim_step_progress": progress,
            "epoch_progress": progress}
    hparams = {f"layer_{i}": {"hidden": 1024, "heads": 16, "dropout": 0.1, "act": "gelu", "name": f"block.{i}",
                              "init": {"std": 0.02, "mean": 0.0, "kind": "normal"}} for i in range(96)}
    hparams.update(lr=3e-4, betas=(0.9, 0.95), data={"paths": [f"/data/shard_{i:05d}.bin" for i in range(400)]})
    param_groups = [{"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1, "amsgrad": False,
                     "foreach": None, "maximize": False, "capturable": False, "differentiable": False,
                     "fused": None, "initial_lr": 3e-4, "params": list(range(g * params, (g + 1) * params))}
                    for g in range(groups)]
    best = {f"/ckpt/epoch={i}-step={i * 100}.ckpt": torch.tensor(0.5 - i / 100) for i in range(20)}
    return {"epoch": 9, "global_step": 1000, "pytorch-lightning_version": "2.4.0", "hparams_name": "kwargs",
            "hyper_parameters": hparams, "loops": {"fit_loop": loop, "validate_loop": {"state_dict": {}},
                                                   "test_loop": {"state_dict": {}}, "predict_loop": {}},
            "callbacks": {"ModelCheckpoint{'monitor': 'val_loss', 'mode': 'min'}": {
                "monitor": "val_loss", "best_model_score": torch.tensor(0.3), "best_model_path": "/ckpt/b.ckpt",
                "current_score": torch.tensor(0.31), "dirpath": "/ckpt", "best_k_models": best,
                "kth_best_model_path": "/ckpt/k.ckpt", "kth_value": torch.tensor(0.4), "last_model_path": ""},
                "EarlyStopping{'monitor': 'val_loss', 'mode': 'min'}": {
                    "wait_count": 0, "stopped_epoch": 0, "best_score": torch.tensor(0.3), "patience": 3}},
            "optimizer_states": [{"state": {}, "param_groups": param_groups}],
            "lr_schedulers": [{"T_max": 1000, "eta_min": 0.0, "base_lrs": [3e-4] * groups, "last_epoch": 1000,
                               "verbose": False, "_step_count": 1001, "_get_lr_called_within_step": False,
                               "_last_lr": [3e-4] * groups}]}


def omegaconf_common(blocks: int = 1250) -> Dict[str, Any]:
    """Hyper-parameters as omegaconf holds them: each node an object pickled with its metadata."""
    from omegaconf import OmegaConf

    conf = {f"block_{i}": {"hidden": 1024, "heads": 16, "dropout": 0.1, "act": "gelu", "tags": ["a", "b", i],
                           "init": {"std": 0.02, "kind": "normal", "seed": i}} for i in range(blocks)}
    return {"epoch": 1, "hyper_parameters": {"conf": OmegaConf.create(conf)}}


def data_pkl(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as z:
        return z.read(next(n for n in z.namelist() if n.endswith("/data.pkl")))


def load_module(tree: str, name: str) -> Any:
    """``tree``'s pickle_scan.py as a module of this package (its relative imports resolve here)."""
    path = os.path.join(tree, "lightning_distckpt", "storage", "pickle_scan.py")
    spec = importlib.util.spec_from_file_location(f"lightning_distckpt.storage.{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _quartiles(values: List[float]) -> List[float]:
    if len(values) < 2:
        return [values[0], values[0]]
    q = statistics.quantiles(values, n=4)
    return [q[0], q[2]]


def timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ab", default=None, help="a tree whose scanner is 'before' (e.g. git archive HEAD)")
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--load-repeats", type=int, default=3, help="full safe loads timed (seconds each)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    trees = {"after": load_module(here, "_bench_after")}
    if args.ab:
        trees = {"before": load_module(args.ab, "_bench_before"), **trees}
    from lightning_distckpt.storage.safe_pickle import load_file

    cases = {"lightning": lightning_common(), "omegaconf": omegaconf_common()}
    raws = {name: data_pkl(obj) for name, obj in cases.items()}
    archives = {}
    for name, obj in cases.items():
        archives[name] = os.path.join("/tmp", f"bench_pickle_scan_{name}.pt")
        torch.save(obj, archives[name])
    times: Dict[str, List[float]] = {}
    for i in range(args.repeats):
        for name, raw in raws.items():
            for tree, mod in trees.items():
                times.setdefault(f"{name} bytes {tree}", []).append(timed(lambda: mod.check_pickle_bytes(raw, name)))
                times.setdefault(f"{name} stream {tree}", []).append(
                    timed(lambda: mod.check_pickle(io.BytesIO(raw), name, len(raw))))
            if i < args.load_repeats:
                times.setdefault(f"{name} safe load", []).append(timed(lambda: load_file(archives[name])))
    summary = {k: {"median_ms": statistics.median(v) * 1e3, "min_ms": min(v) * 1e3, "q1_ms": _quartiles(v)[0] * 1e3,
                   "q3_ms": _quartiles(v)[1] * 1e3, "n": len(v)} for k, v in times.items()}
    print(f"{'case':32s} {'median ms':>10s} {'min':>8s} {'q1':>8s} {'q3':>8s}")
    for k, s in summary.items():
        print(f"{k:32s} {s['median_ms']:10.2f} {s['min_ms']:8.2f} {s['q1_ms']:8.2f} {s['q3_ms']:8.2f}")
    speedups = {}
    if args.ab:
        for name, raw in raws.items():
            for kind in ("bytes", "stream"):
                b, a = summary[f"{name} {kind} before"]["median_ms"], summary[f"{name} {kind} after"]["median_ms"]
                speedups[f"{name} {kind}"] = b / a
                print(f"{name} {kind}: {len(raw)} bytes, before {b:.2f} ms, after {a:.2f} ms: {b / a:.1f}x")
    if args.json:
        out = {"command": "python " + " ".join(sys.argv), "machine": {
            "cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
            "platform": platform.platform()}, "loadavg": os.getloadavg(), "args": vars(args),
            "pickle_bytes": {k: len(v) for k, v in raws.items()}, "summary": summary, "speedup": speedups}
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
