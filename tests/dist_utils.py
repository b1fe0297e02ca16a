"""Run a function on N real CPU processes joined in a gloo process group.

``run_distributed(fn, world_size, *args)`` spawns ``world_size`` processes, initializes
torch.distributed (gloo, TCP on a free loopback port), calls ``fn(rank, world_size, *args)`` in
each and re-raises the first failure with its traceback. ``fn`` must be a module-level function.
Returns the list of per-rank return values (must be picklable).
"""

from __future__ import annotations

import datetime
import os
import socket
import traceback
from typing import Any, Callable, List

import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: tuple, results: Any, timeout_s: float) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        try:
            results[rank] = ("ok", fn(rank, world_size, *args))
        finally:
            dist.destroy_process_group()
    except BaseException as e:  # report every failure to the parent with its traceback
        results[rank] = ("error", f"rank {rank}: {type(e).__name__}: {e}\n{traceback.format_exc()}")


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout_s: float = 120.0) -> List[Any]:
    port = free_port()
    with mp.Manager() as manager:
        results = manager.dict()
        mp.start_processes(
            _worker, args=(world_size, port, fn, args, results, timeout_s), nprocs=world_size, join=True,
            start_method="spawn",
        )
        out = dict(results)
    errors = [out[r][1] for r in sorted(out) if out[r][0] == "error"]
    if errors:
        raise AssertionError("\n".join(errors))
    missing = [r for r in range(world_size) if r not in out]
    if missing:
        raise AssertionError(f"ranks {missing} returned no result")
    return [out[r][1] for r in range(world_size)]
