"""Run a function on N real CPU processes joined in a gloo process group.

``run_distributed(fn, world_size, *args)`` spawns ``world_size`` processes, initializes
torch.distributed (gloo, TCP on a free loopback port), calls ``fn(rank, world_size, *args)`` in
each and re-raises the first failure with its traceback. ``fn`` must be a module-level function.
Returns the list of per-rank return values (must be picklable).

Results travel through files (``torch.save`` in the worker, ``torch.load`` here), not a
``multiprocessing.Manager``: a Manager's server process is *forked* from this one, and after
in-process tensorstore or Lightning work this process runs threads; a fork taken while one of them
holds a libc lock crashed the server (a segfault in libc, seen in CI). Workers leave with
``os._exit`` once their result is written (see ``_worker``).
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import random
import socket
import sys
import tempfile
import traceback
from typing import Any, Callable, List

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


_RANDOM = random.SystemRandom()  # not the seeded module state forked children share
_PORT_BAND = 2000  # ports per xdist worker, below the kernel's ephemeral range (32768-60999 by default)


def free_port() -> int:
    """A loopback port free now, for a test's process group or server. Not one the kernel hands out (bind to
    port 0): between this check and the TCPStore's listen, any connection of another test running at the same
    time (xdist workers) could take such a port as its source port (seen: EADDRINUSE, then the other rank's
    120 s connect timeout). So a port from this xdist worker's own band below the ephemeral range."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    base = 20000 + (index % 6) * _PORT_BAND
    for _ in range(200):
        port = base + _RANDOM.randrange(_PORT_BAND)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # the band is full: any port
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: tuple, out_dir: str, timeout_s: float,
            environ: dict) -> None:
    # The fork server's environment is the one it started with: take the caller's, as spawn would.
    os.environ.clear()
    os.environ.update(environ)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ[_RESULTS_ENV] = out_dir  # where die_now leaves its result
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        try:
            result = ("ok", fn(rank, world_size, *args))
        finally:
            dist.destroy_process_group()
    except BaseException as e:  # report every failure to the parent with its traceback
        result = ("error", f"rank {rank}: {type(e).__name__}: {e}\n{traceback.format_exc()}")
    tmp = os.path.join(out_dir, f".rank{rank}.pt")
    torch.save(result, tmp)
    os.replace(tmp, os.path.join(out_dir, f"rank{rank}.pt"))  # complete or absent
    # The result is on disk: skip interpreter finalization, where C++ worker threads (gloo's,
    # tensorstore's) torn down late occasionally abort the process ("terminate called without an
    # active exception", SIGABRT; pytorch/pytorch#179291), failing a test whose work succeeded.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


_RESULTS_ENV = "LDC_TEST_RESULTS_DIR"


def die_now(rank: int, result: Any = "died") -> None:
    """End this worker at once, as a killed rank would (its sockets closed, no process group torn
    down, nothing after this runs), leaving ``result`` as its outcome for :func:`run_distributed`."""
    out_dir = os.environ[_RESULTS_ENV]
    torch.save(("ok", result), os.path.join(out_dir, f".rank{rank}.pt"))
    os.replace(os.path.join(out_dir, f".rank{rank}.pt"), os.path.join(out_dir, f"rank{rank}.pt"))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # 0: start_processes would stop the other ranks on another code


# Workers start from a fork server that imported torch, tensorstore and the package once (a spawned
# worker imports them again, ~3 s of CPU each, most of the suite's process start-up). The server
# forks before any test code runs in it: no threads, no process group, no tensorstore context yet.
# Lightning too, for the scripts ``script_ranks`` runs (~3.5 s more, once per session).
_PRELOAD = ["torch", "torch.distributed", "tensorstore", "lightning_distckpt", "lightning_distckpt.serialization",
            "lightning.pytorch", "lightning.fabric", "lightning_distckpt.lightning"]


def _start_method() -> str:
    if os.environ.get("LDC_TEST_START_METHOD"):  # e.g. "spawn", to rule the fork server out
        return os.environ["LDC_TEST_START_METHOD"]
    multiprocessing.set_forkserver_preload(_PRELOAD)
    return "forkserver"


def fork_server_context() -> multiprocessing.context.BaseContext:
    """The multiprocessing context workers start from (the fork server, unless overridden)."""
    return multiprocessing.get_context(_start_method())


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout_s: float = 120.0) -> List[Any]:
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="run_distributed_") as out_dir:
        mp.start_processes(
            _worker, args=(world_size, port, fn, args, out_dir, timeout_s, dict(os.environ)), nprocs=world_size, join=True,
            start_method=_start_method(),
        )
        out = {}
        for r in range(world_size):
            path = os.path.join(out_dir, f"rank{r}.pt")
            if os.path.exists(path):
                out[r] = torch.load(path, weights_only=False)  # our own workers' results
    errors = [out[r][1] for r in sorted(out) if out[r][0] == "error"]
    if errors:
        raise AssertionError("\n".join(errors))
    missing = [r for r in range(world_size) if r not in out]
    if missing:
        raise AssertionError(f"ranks {missing} returned no result")
    return [out[r][1] for r in range(world_size)]
