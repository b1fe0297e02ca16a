"""A model with tied weights saved: ours stores the tie once (format 8 ``aliases``), torch.save shares the storage,
and ours with the tie broken writes both copies (what a save wrote before ties were found). One process.

    python benchmarks/bench_tied.py --repeats 7 --tag run1

The state is a GPT-like model's fp32 weights: a ``--vocab`` x ``--hidden`` embedding whose output layer
(``lm_head.weight``) is the same tensor, as ``module.state_dict()`` of a Hugging Face model with
``tie_word_embeddings=True`` gives it (two detached views of one memory), and ``--layers`` blocks of four
``hidden x 4*hidden``-sized matrices. Contestants, interleaved in a rotated order at every repeat, each saving to
a new directory or file on the same disk:

* ``ours_tied``: ``ldc.save`` of that state (the tie stored once);
* ``ours_untied``: ``ldc.save`` with ``lm_head.weight`` a copy (both written);
* ``torch_save``: ``torch.save`` of the same tied state to a temporary name, ``os.replace`` (Lightning's
  ``TorchCheckpointIO``; no fsync);
* ``torch_save_fsync``: the same, the file and its directory fsync'd (durable, as ours is).

Prints medians and interquartile ranges of the seconds and the bytes each wrote, and writes them with the
command line and the load average to ``benchmarks/results/tied_<tag>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Callable, Dict, List

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import lightning_distckpt as ldc  # noqa: E402

from common import dir_bytes, fmt_table, machine_summary  # noqa: E402


def tied_state(vocab: int, hidden: int, layers: int, tied: bool) -> Dict[str, torch.Tensor]:
    """name -> fp32 weight, the embedding and the output layer one memory when ``tied``."""
    g = torch.Generator().manual_seed(0)
    emb = torch.randn(vocab, hidden, generator=g)
    state = {"model.embed_tokens.weight": emb.detach(), "lm_head.weight": emb.detach() if tied else emb.clone()}
    for i in range(layers):
        for name, shape in (("q", (hidden, hidden)), ("o", (hidden, hidden)), ("up", (4 * hidden, hidden)),
                            ("down", (hidden, 4 * hidden))):
            state[f"model.layers.{i}.{name}.weight"] = torch.randn(shape, generator=g)
    return state


def _sharded(state: Dict[str, torch.Tensor]) -> Dict[str, ldc.ShardedTensor]:
    return {k: ldc.ShardedTensor.from_rank_offsets(k, v) for k, v in state.items()}


def _torch_save(state: Dict[str, torch.Tensor], path: str, fsync: bool) -> None:
    tmp = path + ".tmp"
    torch.save(state, tmp)
    if fsync:
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
    os.replace(tmp, path)
    if fsync:
        fd = os.open(os.path.dirname(path), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def contestants(vocab: int, hidden: int, layers: int) -> Dict[str, Callable[[str], None]]:
    tied, untied = tied_state(vocab, hidden, layers, True), tied_state(vocab, hidden, layers, False)
    return {
        "ours_tied": lambda out: ldc.save(_sharded(tied), out),
        "ours_untied": lambda out: ldc.save(_sharded(untied), out),
        "torch_save": lambda out: _torch_save(tied, out + ".pt", fsync=False),
        "torch_save_fsync": lambda out: _torch_save(tied, out + ".pt", fsync=True),
    }


def _written(out: str) -> int:
    return dir_bytes(out) if os.path.isdir(out) else os.path.getsize(out + ".pt")


def run(args: argparse.Namespace) -> Dict[str, Dict[str, List[float]]]:
    runs = contestants(args.vocab, args.hidden, args.layers)
    names = list(runs)
    results: Dict[str, Dict[str, List[float]]] = {n: {"seconds": [], "bytes": []} for n in names}
    root = tempfile.mkdtemp(prefix="bench_tied_", dir=args.dir)
    try:
        for rep in range(args.repeats):
            order = names[rep % len(names):] + names[:rep % len(names)]  # rotated: each meets the same load
            for name in order:
                out = os.path.join(root, f"{name}_{rep}")
                started = time.perf_counter()
                runs[name](out)
                results[name]["seconds"].append(time.perf_counter() - started)
                results[name]["bytes"].append(_written(out))
                shutil.rmtree(out, ignore_errors=True)
                if os.path.exists(out + ".pt"):
                    os.remove(out + ".pt")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return results


def _quartiles(values: List[float]) -> List[float]:
    q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return [q[0], statistics.median(values), q[2]]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--dir", default=None, help="where to save (default: the system's temporary directory)")
    p.add_argument("--tag", default=None, help="write benchmarks/results/tied_<tag>.json")
    args = p.parse_args()
    load_before = os.getloadavg()
    results = run(args)
    summary = {n: {"seconds_q1_median_q3": _quartiles(r["seconds"]), "bytes": statistics.median(r["bytes"])}
               for n, r in results.items()}
    rows = [[n, f"{s['seconds_q1_median_q3'][1]:.3f}",
             f"{s['seconds_q1_median_q3'][0]:.3f}-{s['seconds_q1_median_q3'][2]:.3f}",
             f"{s['bytes'] / 1e6:.1f}"] for n, s in summary.items()]
    print(fmt_table(["contestant", "median s", "IQR s", "MB written"], rows))
    if args.tag:
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", f"tied_{args.tag}.json")
        with open(path, "w") as f:
            json.dump({"command": " ".join(["python", "benchmarks/bench_tied.py", *sys.argv[1:]]),
                       "load_before": load_before, "load_after": os.getloadavg(), "machine": machine_summary(),
                       "summary": summary, "results": results}, f, indent=1)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
