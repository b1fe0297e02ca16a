"""The fixed cost of a save, and the per-key cost of many small tensors: 2 gloo processes on CPU.

    python benchmarks/bench_small_state.py --rounds 3 --repeats 8 --tag run1
    python benchmarks/bench_small_state.py --ab /path/to/old/checkout --rounds 4 --tag ab1   # A/B, interleaved

Two parts, each round a fresh pair of processes (``torch.multiprocessing`` spawn, gloo):

* **fixed**: a 2 MB state (8 fp32 tensors of 256 KB, replicated over both ranks as in DDP, and a
  small common state) saved ``--repeats`` times in a row, each time to a new directory, with a
  :class:`SavePlanCache` (as ``DistCheckpointStrategy`` keeps one). Interleaved with each of ours
  (rotated order), the stock reference on rank 0: ``torch.save`` to a temporary name and
  ``os.replace`` (what Lightning's ``TorchCheckpointIO`` does, no fsync), and the same with the
  file and its directory fsync'd, each followed by a barrier (Lightning's after a save). Timed on
  rank 0 from a barrier to the end of the save.
* **tiny**: ``--tiny`` tensors of 16 fp32 each, half split over the 2 ranks (global shape 32), half
  replicated, saved ``--tiny-repeats`` times (no plan cache: a fresh plan each) and loaded back
  (``--loader``: ``every_rank``, ``parallel`` or ``two_stage``, the default) into a template of the same
  layout; timed on rank 0 from a barrier (wall and CPU).

Each save is also timed in rank 0's CPU seconds (``_cpu``: ``time.process_time``, every thread of
the process), which a busy machine inflates far less than wall time.

Prints medians and interquartile ranges over every timed repeat of every round, and writes them with
the command line and the load average to ``benchmarks/results/small_state_<tag>.json``.

``--ab OLD`` runs each round once with the library of ``OLD`` (a checkout, first on ``sys.path``)
and once with this checkout, alternating which goes first, so both meet the same machine load.
``--count`` also counts, per save of ours, the collectives (top-level ``torch.distributed`` calls
of the library) and, with ``strace`` installed, the fsync / fdatasync calls of both ranks.
``--phases`` times, per save of ours and on each rank's main thread, the steps of the save (wall
and process CPU seconds, medians): where the fixed cost goes (issue 29).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Dict, Iterator, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
FIXED_TENSORS, FIXED_NUMEL = 8, 65536  # 8 x 256 KB fp32 = 2 MB
COLLECTIVES = ("all_gather_object", "broadcast_object_list", "scatter_object_list", "gather_object",
               "send_object_list", "recv_object_list", "all_reduce", "all_gather", "broadcast", "barrier",
               "isend", "irecv")


def _quantiles(xs: List[float]) -> Dict[str, float]:
    """Median and interquartile range (of at least one value)."""
    if len(xs) == 1:
        return {"median": xs[0], "q1": xs[0], "q3": xs[0], "n": 1}
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return {"median": statistics.median(xs), "q1": q[0], "q3": q[2], "n": len(xs)}


# -- one round: two processes ------------------------------------------------------------------
def _worker(rank: int, port: int, args: Dict[str, Any], out: str) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        result = _round(rank, args, torch, dist)
        if rank == 0:
            with open(out, "w") as f:
                json.dump(result, f)
    finally:
        dist.destroy_process_group()


def _marker(which: str) -> None:
    """A syscall strace is told to trace too, bracketing the saves counted (``--count``)."""
    os.access(f"/__bench_small_state_{which}__", os.F_OK)


def _counting(dist: Any) -> Dict[str, int]:
    """Count the library's top-level collectives (it calls them as ``dist.<name>``)."""
    counts: Dict[str, int] = {}
    for name in COLLECTIVES:
        fn = getattr(dist, name)

        def wrapped(*a: Any, _fn: Callable = fn, _name: str = name, **k: Any) -> Any:
            counts[_name] = counts.get(_name, 0) + 1
            return _fn(*a, **k)
        setattr(dist, name, wrapped)
    return counts


@contextlib.contextmanager
def _fsyncs_off() -> Iterator[None]:
    """Within the block, saves of ours skip every fsync (Python's ``os.fsync`` and tensorstore's
    ``file_io_sync``): what the durability guarantee costs, measured. Benchmarks only: such a
    save is not crash safe."""
    from lightning_distckpt.storage.local_store import LocalStore

    context, fsync = LocalStore.ts_context, os.fsync

    def unsynced(self: Any, options: Any) -> Any:
        import tensorstore as ts

        ours = context(self, options)  # (its parent holds the executors: storage/ts_context.py)
        return ts.Context({**ours.spec.to_json(), "file_io_sync": False}, parent=ours.parent)

    LocalStore.ts_context = unsynced  # type: ignore[method-assign]
    os.fsync = lambda fd: None
    try:
        yield
    finally:
        LocalStore.ts_context, os.fsync = context, fsync  # type: ignore[method-assign]


# (module, attribute path, label): the steps of a save, timed on the main thread by --phases; a step a
# version of the library lacks is left out
PHASES = (("lightning_distckpt.serialization", "prepare_save", "prepare_save"),
          ("lightning_distckpt.saving.save_prepare", "_describe", "  describe"),
          ("lightning_distckpt.storage.local_store", "LocalStore.begin", "  begin (staging dirs, owner note)"),
          ("lightning_distckpt.serialization", "write_local", "write_local"),
          ("lightning_distckpt.storage.tensorstore_write", "TensorStoreWrites.write", "  shard writes"),
          ("lightning_distckpt.storage.tensorstore_write", "TensorStoreWrites._stage_writes", "    stage (open, write)"),
          ("lightning_distckpt.storage.local_store", "LocalStore.make_durable", "    make durable (fsyncs)"),
          ("lightning_distckpt.serialization", "finalize_save", "finalize_save"),
          ("lightning_distckpt.storage.local_store", "LocalStore.commit", "  commit (rank 0)"),
          ("lightning_distckpt.comm", "Comm.agree", "agree"))


def _phase_timers() -> Dict[str, List[float]]:
    """Wrap the steps of :data:`PHASES`; returns the per-save sums being filled (label -> [wall, cpu]).
    ``Comm.agree`` is labelled by its place in the save (1: handshake, 2: outcomes, 3: commit)."""
    import importlib
    import threading

    current: Dict[str, List[float]] = {}
    for module, attr, label in PHASES:
        owner: Any = importlib.import_module(module)
        *path, name = attr.split(".")
        for part in path:
            owner = getattr(owner, part, None)
        fn = getattr(owner, name, None)
        if fn is None:
            continue

        def timed(*a: Any, _fn: Callable = fn, _label: str = label, **k: Any) -> Any:
            if threading.current_thread() is not threading.main_thread():
                return _fn(*a, **k)
            if _label == "agree":
                _label = f"agree {sum(key.startswith('agree') for key in current) + 1}"
            t, c = time.perf_counter(), time.process_time()
            try:
                return _fn(*a, **k)
            finally:
                spent = current.setdefault(_label, [0.0, 0.0])
                spent[0] += time.perf_counter() - t
                spent[1] += time.process_time() - c
        setattr(owner, name, timed)
    return current


def _round(rank: int, args: Dict[str, Any], torch: Any, dist: Any) -> Dict[str, Any]:
    import lightning_distckpt as ldc
    from lightning_distckpt.saving.save import SavePlanCache

    root = args["dir"]
    barrier = lambda: dist.barrier()  # noqa: E731
    res: Dict[str, Any] = {"library": os.path.dirname(ldc.__file__), "fixed": {}, "tiny": {}}
    counts = _counting(dist) if args["count"] else None
    phase_now = _phase_timers() if args["phases"] else None
    phases: Dict[str, Dict[str, List[float]]] = {}
    # -- fixed cost --------------------------------------------------------------------------
    g = torch.Generator().manual_seed(0)
    tensors = {f"layer{i}.weight": torch.randn(FIXED_NUMEL, generator=g) for i in range(FIXED_TENSORS)}
    sd = {k: ldc.ShardedTensor.from_rank_offsets(k, t, replica_id=rank) for k, t in tensors.items()}
    sd["step"] = 7
    cache = SavePlanCache()
    times: Dict[str, List[float]] = {"ours": [], "ours_nosync": [], "stock": [], "stock_fsync": []}
    ldc.save(sd, os.path.join(root, "warm"), plan_cache=cache)  # first save plans; not timed

    def ours(i: int) -> None:
        ldc.save(sd, os.path.join(root, f"ours_{i}"), plan_cache=cache)

    def stock(i: int, fsync: bool = False) -> None:
        if rank == 0:
            path = os.path.join(root, f"stock_{i}.ckpt")
            with open(path + ".tmp", "wb") as f:
                torch.save({"state_dict": tensors, "step": 7}, f)
                if fsync:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(path + ".tmp", path)
            if fsync:
                fd = os.open(root, os.O_RDONLY)
                os.fsync(fd)
                os.close(fd)
        barrier()

    def ours_unsynced(i: int) -> None:
        with _fsyncs_off():
            ldc.save(sd, os.path.join(root, f"ours_nosync_{i}"), plan_cache=cache)

    cpu: Dict[str, List[float]] = {name: [] for name in times}
    runs = {"ours": ours, "ours_nosync": ours_unsynced, "stock": stock, "stock_fsync": lambda i: stock(i, True)}
    order = list(runs)
    collectives: List[Dict[str, int]] = []
    for i in range(args["repeats"]):
        order = order[1:] + order[:1]
        for name in order:
            barrier()
            if name == "ours" and counts is not None:
                counts.clear()
                _marker("begin")
            if phase_now is not None:
                phase_now.clear()
            t0, c0 = time.perf_counter(), time.process_time()
            runs[name](i)
            if name == "ours" and phase_now is not None:
                for label, (wall, cpu_s) in phase_now.items():
                    phases.setdefault(label, {"wall": [], "cpu": []})
                    phases[label]["wall"].append(wall)
                    phases[label]["cpu"].append(cpu_s)
            times[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
            if name == "ours" and counts is not None:
                _marker("end")
                collectives.append(dict(counts))
        barrier()
        if rank == 0:  # out of the timing: the next save starts from a like directory
            for p in os.listdir(root):
                if p.startswith(("ours_", "stock_")):  # ours_nosync_ too
                    shutil.rmtree(os.path.join(root, p), ignore_errors=True) if os.path.isdir(
                        os.path.join(root, p)) else os.remove(os.path.join(root, p))
        barrier()
    res["fixed"] = {**times, **{f"{name}_cpu": xs for name, xs in cpu.items()}}
    if counts is not None:
        res["collectives_per_save"] = collectives[-1] if collectives else {}
    if phase_now is not None:  # every rank's, gathered on rank 0 (which writes the round's results)
        gathered: List[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, phases)
        res["phases"] = {f"rank {r}": p for r, p in enumerate(gathered)}
    # -- many tiny tensors -------------------------------------------------------------------
    n = args["tiny"]
    half = n // 2

    def tiny_sd(fill: bool) -> Dict[str, Any]:
        out: Dict[str, Any] = {}
        for i in range(half):
            t = torch.full((16,), float(i * 2 + rank)) if fill else torch.zeros(16)
            out[f"sharded.{i}"] = ldc.ShardedTensor.from_rank_offsets(f"sharded.{i}", t, (0, rank, 2))
        for i in range(n - half):
            t = torch.full((16,), float(i)) if fill else torch.zeros(16)
            out[f"replicated.{i}"] = ldc.ShardedTensor.from_rank_offsets(f"replicated.{i}", t, replica_id=rank)
        return out

    saved, tiny = tiny_sd(True), {"save": [], "save_cpu": [], "load": [], "load_cpu": []}
    for i in range(args["tiny_repeats"]):
        path = os.path.join(root, f"tiny_{i}")
        barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        ldc.save(saved, path)
        tiny["save"].append(time.perf_counter() - t0)
        tiny["save_cpu"].append(time.process_time() - c0)  # rank 0's CPU seconds, all threads: less load-bound
        template = tiny_sd(False)
        barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        loaded = ldc.load(template, path, loader=args.get("loader"))
        tiny["load"].append(time.perf_counter() - t0)
        tiny["load_cpu"].append(time.process_time() - c0)
        got = loaded[f"sharded.{half - 1}"]
        assert float(got[0]) == float((half - 1) * 2 + rank), "tiny load returned wrong values"
    res["tiny"] = tiny
    return res


def run_round(args: argparse.Namespace, tree: str) -> Dict[str, Any]:
    """One round in a fresh interpreter importing the library from ``tree``."""
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        out = os.path.join(tmp, "round.json")
        cmd = [sys.executable, os.path.abspath(__file__), "--_round", out, "--_tree", tree,
               "--repeats", str(args.repeats), "--tiny", str(args.tiny), "--tiny-repeats", str(args.tiny_repeats)]
        if args.loader:
            cmd += ["--loader", args.loader]
        trace = os.path.join(tmp, "strace.txt")
        if args.phases:
            cmd.append("--phases")
        if args.count:
            cmd.append("--count")
            if shutil.which("strace"):
                calls = "trace=fsync,fdatasync,access,faccessat,faccessat2"
                cmd = ["strace", "-f", "-qq", "-e", calls, "-o", trace] + cmd
        subprocess.run(cmd, check=True)
        with open(out) as f:
            res = json.load(f)
        if args.count and os.path.exists(trace):
            res["fsyncs_per_save"] = _fsyncs_between_markers(trace)
        return res


def _fsyncs_between_markers(trace: str) -> Optional[float]:
    """fsync + fdatasync calls of both ranks (any thread) while a save is between its markers, per save."""
    open_saves, fsyncs, begins = 0, 0, 0
    call = re.compile(r"^\d+\s+(\w+)\(")
    with open(trace) as f:
        for line in f:
            if "__bench_small_state_begin__" in line:
                open_saves, begins = open_saves + 1, begins + 1
            elif "__bench_small_state_end__" in line:
                open_saves -= 1
            else:
                m = call.match(line)
                fsyncs += bool(m and m.group(1) in ("fsync", "fdatasync") and open_saves > 0)
    saves = begins // 2  # each rank marks every save
    return fsyncs / saves if saves else None


def _child(out: str, tree: str, repeats: int, tiny: int, tiny_repeats: int, count: bool, phases: bool,
           loader: Optional[str] = None) -> None:
    """Entry of one round's interpreter: the library from ``tree``, two spawned ranks."""
    sys.path.insert(0, os.path.dirname(HERE))
    from benchmarks.common import free_port

    sys.path.insert(0, tree)  # first: the spawned ranks import the library from ``tree``
    import torch.multiprocessing as mp

    root = tempfile.mkdtemp(dir=os.path.dirname(out))
    params = {"dir": root, "repeats": repeats, "tiny": tiny, "tiny_repeats": tiny_repeats, "count": count,
              "phases": phases, "loader": loader}
    mp.spawn(_worker, args=(free_port(), params, out), nprocs=2, join=True)


def summarize(rounds: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Quantiles per measurement over every repeat of every round."""
    out: Dict[str, Any] = {}
    for part in ("fixed", "tiny"):
        for name in rounds[0][part]:
            out[f"{part} {name}"] = _quantiles([x for r in rounds for x in r[part][name]])
    for extra in ("collectives_per_save", "fsyncs_per_save"):
        if extra in rounds[-1]:
            out[extra] = rounds[-1][extra]
    if "phases" in rounds[0]:  # ms: median wall and CPU per save, over every round
        out["phases_ms"] = {
            rank: {label: [round(1e3 * statistics.median(x for r in rounds for x in r["phases"][rank][label][what]), 3)
                           for what in ("wall", "cpu")] for label in per_label}
            for rank, per_label in rounds[0]["phases"].items()}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--repeats", type=int, default=8, help="saves of the 2 MB state per round (each contestant)")
    p.add_argument("--tiny", type=int, default=10000, help="tiny tensors")
    p.add_argument("--tiny-repeats", type=int, default=2)
    p.add_argument("--loader", default=None, choices=("every_rank", "parallel", "two_stage"),
                   help="the loader of the tiny loads (default: load's default)")
    p.add_argument("--ab", default=None, help="an older checkout to compare with, interleaved")
    p.add_argument("--count", action="store_true", help="count collectives and fsyncs per save")
    p.add_argument("--phases", action="store_true", help="time the steps of each save of ours, per rank")
    p.add_argument("--dir", default=None, help="where checkpoints go (default: a temporary directory)")
    p.add_argument("--tag", default=None, help="writes benchmarks/results/small_state_<tag>.json")
    p.add_argument("--_round", default=None, help=argparse.SUPPRESS)
    p.add_argument("--_tree", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args._round:
        _child(args._round, args._tree, args.repeats, args.tiny, args.tiny_repeats, args.count, args.phases,
               args.loader)
        return
    sys.path.insert(0, os.path.dirname(HERE))
    from benchmarks.common import fmt_table, run_header

    started, load_before = time.time(), os.getloadavg()
    trees = {"after": os.path.dirname(HERE)}
    if args.ab:
        trees = {"before": os.path.abspath(args.ab), **trees}
    rounds: Dict[str, List[Dict[str, Any]]] = {v: [] for v in trees}
    for r in range(args.rounds):
        for version in (list(trees) if r % 2 == 0 else list(trees)[::-1]):
            rounds[version].append(run_round(args, trees[version]))
            print(f"round {r} {version} done (load {os.getloadavg()[0]:.2f})", file=sys.stderr)
    summary = {v: summarize(rs) for v, rs in rounds.items()}
    rows = []
    for what in summary["after"]:
        if not isinstance(summary["after"][what], dict) or "median" not in summary["after"][what]:
            continue
        rows.append([what] + [f"{summary[v][what]['median']:.4f} ({summary[v][what]['q1']:.4f}-"
                              f"{summary[v][what]['q3']:.4f})" for v in trees])
    print(fmt_table(["seconds: median (IQR)"] + list(trees), rows))
    for v in trees:
        for extra in ("collectives_per_save", "fsyncs_per_save"):
            if extra in summary[v]:
                print(f"{v} {extra}: {summary[v][extra]}")
        for rank, per_label in summary[v].get("phases_ms", {}).items():
            print(f"{v} {rank}, ms per save (wall / CPU):")
            for label, (wall, cpu_ms) in per_label.items():
                print(f"    {label:36s} {wall:7.3f} / {cpu_ms:7.3f}")
    record = {**run_header(args, started, load_before, os.getloadavg()), "trees": trees, "summary": summary,
              "rounds": rounds}
    if args.tag:
        path = os.path.join(HERE, "results", f"small_state_{args.tag}.json")
        with open(path, "w") as f:
            json.dump(record, f, indent=1)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
