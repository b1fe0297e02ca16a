"""Planning a save at 8 to 16,384 ranks, simulated in one process: what each stage costs per rank.

    .venv/bin/python benchmarks/bench_planning.py [--clock cpu] --out benchmarks/results/planning_run9[_cpu].json

Layouts (records only, no tensors):

- ``megatron``: a 96-layer GPT (``benchmarks/common.gpt_params``: 1,155 parameters, 4 states each,
  4,620 tensors) over TP x PP x DP (TP = 8, PP = 8 when there are ranks for it, DP the rest);
  stage ``pp`` holds its 96 / PP layers; the first DP replica holds the main replicas.
- ``fsdp``: a 12-layer GPT (588 tensors), every tensor split along dim 0 over all ranks: every
  rank's records differ, but each is its chunk of an even split (``planning/even.py``), so all
  ranks share one layout; the index records each such tensor as one rule
  (``planning/even_index.py``, format 4), not tensors x ranks shards.
- ``validate_dim0``: ``validate_tensor_records`` alone, 4 tensors x B boxes (dim-0 sharding).

Stages of a first save (``saving/save_coordinate.py``; exchange bytes are pickles as
torch.distributed sends them, unpickling timed as the receiving rank does it):

- ``digest``: one rank marks its even chunks and hashes its records (``planning/even.mark_even``,
  ``planning/groups.layout_digest``);
- ``handshake``: every rank receives every rank's handshake (all-gathered) and unpickles them;
- ``gather``: rank 0 receives and unpickles one record list per distinct layout;
- ``validate`` / ``plan``: rank 0, once per layout group (``resolve_even`` and
  ``validate_record_groups``, ``plan_record_groups``);
- ``scatter``: rank 0 pickles every rank's part; each rank receives the largest part's size
  and unpickles its own;
- ``metadata``: rank 0 writes metadata.json's index (JSON), a loading rank parses it;
  ``metadata_shards_s``: listing every stored shard of the parsed index (what validate, inspect
  and convert do; a load lists only the chunks it reads).

Seconds are wall-clock (``--clock cpu``: this process's CPU time). ``planning_s`` (first save) sums
the stages on the critical path (digest, handshake, gather,
validate, plan, scatter); ``steady_s`` is a save reusing a cached plan (digest, handshake, cache
key comparison). Network time is not simulated. ``allgather`` columns: the previous design
(every rank receives and unpickles every rank's records, validates and plans; the collector on),
measured while it stays under ``--allgather-max-records`` records in all.

In the megatron layout, records are built once per distinct layout (ranks with the same layout send
only their handshake); handshakes are built and pickled for every rank.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pickle
import sys
import time
from typing import Any, Callable, Dict, List, Tuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import STATES, fmt_table, gpt_params, machine_summary  # noqa: E402
from lightning_distckpt.planning.even import mark_even, own_records, resolve_even  # noqa: E402
from lightning_distckpt.planning.groups import RankRecords, RecordGroup, layout_digest, representatives  # noqa: E402
from lightning_distckpt.planning.metadata import CheckpointIndex, ShardRecord  # noqa: E402
from lightning_distckpt.planning.save_plan import make_save_plan, plan_record_groups  # noqa: E402
from lightning_distckpt.planning.validation import (  # noqa: E402
    validate_object_records, validate_record_groups, validate_tensor_records,
)
from lightning_distckpt.core.gc_pause import gc_paused  # noqa: E402
from lightning_distckpt.core.format_versions import FORMAT_VERSION  # noqa: E402
from lightning_distckpt.saving.save_coordinate import parts_of  # noqa: E402
from lightning_distckpt.saving.save_prepare import Handshake, PlanningOptions  # noqa: E402

DTYPE = {"model": "bfloat16"}
PACK = 1 << 18  # StorageOptions' default pack_max_bytes


CLOCK = {"wall": time.perf_counter, "cpu": time.process_time}
_clock = CLOCK["wall"]


def _timed(fn: Callable[[], Any]) -> Tuple[float, Any]:
    """Seconds ``fn`` took on the chosen clock (``--clock``), and its result."""
    t0 = _clock()
    out = fn()
    return _clock() - t0, out


def _records(specs, held, rank: int, tp: int, tp_size: int, main_split: bool, main_whole: bool) -> RankRecords:
    """One rank's records: every state of the parameters ``held``, TP-split where they are."""
    out = []
    for n in held:
        spec = specs[n]
        for state, _ in STATES:
            dtype = DTYPE.get(state, "float32")
            if spec.tp_axis is None:
                out.append(ShardRecord(f"{state}.{spec.name}", dtype, spec.shape, (0,) * len(spec.shape), spec.shape,
                                       None, main_whole, rank))
                continue
            shape = list(spec.shape)
            shape[spec.tp_axis] //= tp_size
            offset = [0] * len(shape)
            offset[spec.tp_axis] = tp * shape[spec.tp_axis]
            out.append(ShardRecord(f"{state}.{spec.name}", dtype, spec.shape, tuple(offset), tuple(shape), None,
                                   main_split, rank))
    return RankRecords(out, [])


def megatron(world: int) -> Tuple[List[str], Dict[str, RankRecords]]:
    """Each rank's layout digest, and the records of each digest's first rank."""
    tp_size = min(8, world)
    pp_size = min(8, world // tp_size)
    dp_size = world // (tp_size * pp_size)
    layers = 96
    specs = gpt_params(175 * 10**9 * 14, layers=layers)
    per_layer = (len(specs) - 3) // layers  # embedding first, two final norms last
    digests: List[str] = [""] * world
    first: Dict[str, RankRecords] = {}
    for pp in range(pp_size):
        lo, hi = pp * layers // pp_size, (pp + 1) * layers // pp_size
        held = list(range(1 + lo * per_layer, 1 + hi * per_layer))
        held = ([0] if pp == 0 else []) + held + ([len(specs) - 2, len(specs) - 1] if pp == pp_size - 1 else [])
        for tp in range(tp_size):
            for dp0 in (True, False):
                ranks = [tp + tp_size * (dp + dp_size * pp) for dp in (range(1) if dp0 else range(1, dp_size))]
                if not ranks:
                    continue
                recs = mark_even(_records(specs, held, ranks[0], tp, tp_size, dp0, dp0 and tp == 0), world)
                d = layout_digest(recs)
                first[d] = recs
                for rk in ranks:
                    digests[rk] = d
    return digests, first


def fsdp(world: int) -> Tuple[List[str], Dict[str, RankRecords]]:
    layers, h = 12, 2048
    specs = gpt_params((12 * layers + 4) * h * h * 14, layers=layers)
    digests, first = [], {}
    for rank in range(world):
        out = []
        for spec in specs:
            rows = -(-spec.shape[0] // world)
            lo, hi = min(rank * rows, spec.shape[0]), min((rank + 1) * rows, spec.shape[0])
            shape = (hi - lo,) + spec.shape[1:]
            if hi == lo:
                continue  # ranks past a tensor's rows hold none of it
            for state, _ in STATES:
                out.append(ShardRecord(f"{state}.{spec.name}", DTYPE.get(state, "float32"), spec.shape,
                                       (lo,) + (0,) * (len(spec.shape) - 1), shape, None, True, rank))
        recs = mark_even(RankRecords(out, []), world)  # as save_prepare describes a rank's records
        digests.append(layout_digest(recs))
        first.setdefault(digests[-1], recs)
    return digests, first


def measure(layout: str, world: int, allgather_max_records: int) -> Dict[str, Any]:
    digests, first = (megatron if layout == "megatron" else fsdp)(world)
    options = PlanningOptions(balance_writes=True, pack_max_bytes=PACK)
    row: Dict[str, Any] = {"layout": layout, "ranks": world, "layouts": len(first),
                           "records": sum(len(first[d].tensors) for d in digests)}
    # handshakes: every rank's, pickled as Comm.agree sends them (error, payload)
    pickles = [pickle.dumps((None, Handshake(d, None, "/ckpt/.staging" if r == 0 else None, None, options)))
               for r, d in enumerate(digests)]
    row["digest_s"], _ = _timed(lambda: layout_digest(mark_even(first[digests[0]], world)))
    row["handshake_bytes"] = sum(map(len, pickles))
    with gc_paused():  # as prepare_save exchanges the handshakes
        row["handshake_s"], _ = _timed(lambda: [pickle.loads(p) for p in pickles])
    sent = {d: pickle.dumps(first[d]) for d in first}
    row["gather_bytes"] = sum(map(len, sent.values()))
    with gc_paused():  # as coordinate_plan runs these stages
        row["gather_s"], received = _timed(lambda: {d: pickle.loads(p) for d, p in sent.items()})
        groups = [RecordGroup(received[d], ranks) for d, ranks in representatives(digests).items()]
        resolve_s, (groups, even, derived) = _timed(lambda: resolve_even(groups, world))
        row["validate_s"], problems = _timed(lambda: validate_record_groups(groups, even))
        row["validate_s"] += resolve_s
        assert not problems, problems[:3]
        row["plan_s"], plan = _timed(lambda: plan_record_groups(groups, world, True, PACK, even, derived))
        pickle_s, part_pickles = _timed(lambda: [pickle.dumps(p) for p in parts_of(plan, world, derived)])
    biggest = max(part_pickles, key=len)
    row["scatter_bytes"] = len(biggest)  # scatter_object_list pads every part to the largest
    last = first[digests[-1]]  # the last rank's records: it derives its even chunks' writes, if any
    row["scatter_s"] = pickle_s + _timed(lambda: pickle.loads(biggest).writes_of(last, world - 1, PACK))[0]
    row["received_per_rank_bytes"] = row["handshake_bytes"] + row["scatter_bytes"]
    row["received_rank0_bytes"] = row["received_per_rank_bytes"] + row["gather_bytes"]
    with gc_paused():  # as finalize_save writes metadata.json
        row["metadata_write_s"], text = _timed(lambda: json.dumps({"format_version": FORMAT_VERSION,
                                                                   **plan.index.to_json()}))
    row["metadata_bytes"] = len(text)
    row["metadata_read_s"], index = _timed(lambda: CheckpointIndex.from_json(json.loads(text), "ckpt"))
    # a loader's first use of the stored shards (storage/tensorstore_io.py lists the packed ones)
    row["metadata_shards_s"], _ = _timed(lambda: sum(len(e.shards) for e in index.tensors.values()))
    row["planning_s"] = sum(row[f"{s}_s"] for s in ("digest", "handshake", "gather", "validate", "plan", "scatter"))
    key = first[digests[0]]
    compare_s, _ = _timed(lambda: (key, (0,), True) == (RankRecords(list(key.tensors), []), (0,), True))
    row["steady_s"] = row["digest_s"] + row["handshake_s"] + compare_s
    if row["records"] <= allgather_max_records:
        row.update(_allgather(digests, first, world))
    return row


def _allgather(digests: List[str], first: Dict[str, RankRecords], world: int) -> Dict[str, Any]:
    """The previous design on one rank: receive every rank's records, unpickle, validate, plan."""
    per_rank = [own_records(first[d], rank, world) for rank, d in enumerate(digests)]
    pickles = [pickle.dumps(p) for p in per_rank]
    unpickle_s, got = _timed(lambda: [pickle.loads(p) for p in pickles])
    flat = [r for recs in got for r in recs.tensors]
    validate_s, _ = _timed(lambda: validate_tensor_records(flat) + validate_object_records([]))
    plan_s, _ = _timed(lambda: make_save_plan(flat, [], world, True, PACK))
    return {"allgather_bytes": sum(map(len, pickles)), "allgather_s": unpickle_s + validate_s + plan_s}


def validate_dim0(boxes: int) -> Dict[str, Any]:
    recs = [ShardRecord(f"t{k}", "float32", (boxes * 2, 8), (r * 2, 0), (2, 8), None, True, r)
            for k in range(4) for r in range(boxes)]
    seconds, problems = _timed(lambda: validate_tensor_records(recs))
    assert not problems
    return {"layout": "validate_dim0", "ranks": boxes, "validate_s": seconds}


def exponents(rows: List[Dict[str, Any]], fields: List[str]) -> Dict[str, Dict[str, float]]:
    """Growth exponent of each field with ranks, per layout: slope of log(value) over log(ranks),
    least squares over the rows with at least 256 ranks."""
    out: Dict[str, Dict[str, float]] = {}
    for layout in sorted({r["layout"] for r in rows}):
        pts = [r for r in rows if r["layout"] == layout and r["ranks"] >= 256]
        for f in fields:
            xy = [(math.log(r["ranks"]), math.log(r[f])) for r in pts if r.get(f, 0) > 0]
            if len({x for x, _ in xy}) < 2:
                continue  # repeated runs at one size: no slope
            mx, my = sum(x for x, _ in xy) / len(xy), sum(y for _, y in xy) / len(xy)
            slope = sum((x - mx) * (y - my) for x, y in xy) / sum((x - mx) ** 2 for x, _ in xy)
            out.setdefault(layout, {})[f] = round(slope, 2)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--megatron-ranks", default="8,64,256,1024,4096,16384")
    ap.add_argument("--fsdp-ranks", default="8,64,256,1024,4096")
    ap.add_argument("--validate-boxes", default="64,256,1024,4096,16384")
    ap.add_argument("--allgather-max-records", type=int, default=600_000)
    ap.add_argument("--clock", choices=sorted(CLOCK), default="wall",
                    help="cpu: this process's CPU seconds (less sensitive to other jobs on the machine)")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    global _clock
    _clock = CLOCK[args.clock]
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    rows = [measure("megatron", n, args.allgather_max_records) for n in ints(args.megatron_ranks)]
    rows += [measure("fsdp", n, args.allgather_max_records) for n in ints(args.fsdp_ranks)]
    rows += [validate_dim0(b) for b in ints(args.validate_boxes)]
    fields = ["planning_s", "steady_s", "received_per_rank_bytes", "received_rank0_bytes", "validate_s", "plan_s",
              "allgather_s", "allgather_bytes"]
    result = {"machine": machine_summary(), "clock": args.clock, "load_average": os.getloadavg(), "rows": rows,
              "exponents": exponents(rows, fields)}
    cols = ["layout", "ranks", "layouts", "records", "planning_s", "steady_s", "received_per_rank_bytes",
            "received_rank0_bytes", "handshake_s", "gather_s", "validate_s", "plan_s", "scatter_s",
            "metadata_write_s", "metadata_read_s", "metadata_shards_s", "metadata_bytes", "allgather_s",
            "allgather_bytes"]
    fmt = lambda v: f"{v:.3f}" if isinstance(v, float) else ("" if v is None else str(v))  # noqa: E731
    print(fmt_table(cols, [[fmt(r.get(c)) for c in cols] for r in rows]))
    print(json.dumps(result["exponents"], indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
