"""Shared pieces of the local-tier tests: the state a simulated job saves at each step, the tier
options of 2 simulated nodes of 2 ranks, and a launcher of real rank processes that one of them dies in
(SIGKILL at a named point of the save, then the parent kills the rest: a whole job lost)."""

from __future__ import annotations

import os
import signal
import tempfile
from typing import Dict, Optional

import torch

import lightning_distckpt as ldc
from dist_utils import free_port
from script_ranks import read_log, start_script, stop_all
from lightning_distckpt.tiers import TierOptions

ROWS, COLS = 16, 6


def options(tmp: str, **kw) -> TierOptions:
    """Two ranks per simulated node, each node's local tier its own directory."""
    kw.setdefault("ranks_per_node", 2)
    return TierOptions(local_dir=os.path.join(tmp, "{node}"), **kw)


def full(step: int) -> torch.Tensor:
    """The global tensor "w" at ``step``: distinct values per step and element."""
    return torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS) * 0.5 + step * 1000.0


def state(rank: int, world: int, step: int, template: bool = False, objects: bool = True) -> Dict:
    """A rank's sharded state at ``step`` (rows of "w" split over the ranks, a replicated "b", a
    per-rank object, common state); ``template``: the same layout filled with zeros."""
    rows = ROWS // world
    w = full(step)[rank * rows:(rank + 1) * rows].clone()
    b = torch.full((COLS,), float(step))
    if template:
        w, b = torch.zeros_like(w), torch.zeros_like(b)
    sd = {"w": ldc.ShardedTensor.from_rank_offsets("w", w, (0, rank, world)),
          "b": ldc.ShardedTensor.from_rank_offsets("b", b, replica_id=rank),
          "step": -1 if template else step}
    if objects:
        sd["obj"] = ldc.ShardedObject("rng", None if template else {"rank": rank, "step": step}, (world,), (rank,))
    return sd


def check_loaded(out: Dict, rank: int, world: int, step: int, objects: bool = True) -> None:
    """``out`` is exactly the state of ``step`` (bit for bit)."""
    rows = ROWS // world
    assert torch.equal(out["w"], full(step)[rank * rows:(rank + 1) * rows]), (rank, step, out["w"])
    assert torch.equal(out["b"], torch.full((COLS,), float(step)))
    assert out["step"] == step
    if objects:
        assert out["obj"] == {"rank": rank, "step": step}


WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tier_worker.py")


def run_killed(world: int, scenario: str, tmp: str, victim: int, env: Dict[str, str], timeout_s: float = 120) -> None:
    """Run ``tier_worker.py scenario`` on ``world`` real processes; ``victim`` gets ``env`` (a kill
    point). Waits for the victim to die by SIGKILL (the event: its own death at the named point,
    never a timer), then kills the other ranks, as when a whole job is lost. Fails when the victim
    ends any other way."""
    port = free_port()
    base = dict(os.environ, OMP_NUM_THREADS="1")
    with tempfile.TemporaryDirectory(prefix="run_killed_") as logs:
        procs = [start_script(WORKER, [str(rank), str(world), str(port), scenario, tmp],
                              dict(base, **(env if rank == victim else {})), os.path.join(logs, f"rank{rank}.log"))
                 for rank in range(world)]
        try:
            procs[victim].join(timeout=timeout_s)  # a failure bound, not a schedule
        finally:
            stop_all(procs)  # the other ranks: the whole job is lost
        code: Optional[int] = procs[victim].exitcode
        out = read_log(os.path.join(logs, f"rank{victim}.log"))
    assert code == -signal.SIGKILL, f"rank {victim} ended with {code}, not killed at its point:\n{out[-3000:]}"
