"""The library's collectives keep their tensors until gloo's worker threads have let go of them.

A tensor that Python drops while a gloo worker still holds it (a moment after the collective returned) is
kept alive for the worker, whose release of it then needs the GIL; during interpreter shutdown that kills
the worker inside C++ and the process aborts ("terminate called without an active exception",
pytorch/pytorch#179291). A program whose last act was a save ended so now and then (the README's Fabric
program did in CI). Here: every object collective still carries its values (around the one-message size),
``released`` returns only once the backend holds no reference, and processes that end right after many of
the library's collectives exit cleanly.
"""

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist

from lightning_distckpt.comm import get_comm
from lightning_distckpt.comm_bytes import SMALL_BYTES, released
from dist_utils import free_port, run_distributed

# payload lengths around the head's capacity (a pickled bytes object adds ~30 bytes of framing)
LENGTHS = [0, 10, SMALL_BYTES - 40, SMALL_BYTES, SMALL_BYTES + 1, 5 * SMALL_BYTES, 1 << 20]


def _objects(rank, world):
    comm = get_comm()
    out = []
    for n in LENGTHS:
        mine = bytes([rank + 1]) * (n + rank)  # sizes differ by rank: padding and sizes are exercised
        out.append(("all_gather", n, comm.all_gather_object(mine)))
        out.append(("broadcast", n, comm.broadcast_object(mine if rank == 1 else None, src=1)))
        parts = [bytes([k + 7]) * (n + k) for k in range(world)] if rank == 0 else None
        out.append(("scatter", n, comm.scatter_object(parts, src=0)))
        out.append(("gather", n, comm.gather_from(list(range(world)), mine, dst=1)))
    comm.barrier()
    return out


def test_object_collectives_carry_every_size():
    """all_gather_object, broadcast_object, scatter_object and gather_from return each rank's value, for
    payloads from empty to 1 MiB, across the one-message bound."""
    world = 3
    results = run_distributed(_objects, world)
    for rank, got in enumerate(results):
        for op, n, value in got:
            if op == "all_gather":
                assert value == [bytes([r + 1]) * (n + r) for r in range(world)], (op, n, rank)
            elif op == "broadcast":
                assert value == bytes([2]) * (n + 1), (op, n, rank)
            elif op == "scatter":
                assert value == bytes([rank + 7]) * (n + rank), (op, n, rank)
            else:
                expected = {r: bytes([r + 1]) * (n + r) for r in range(world)} if rank == 1 else {}
                assert value == expected, (op, n, rank)


def _counts_after_release(rank, world):
    from lightning_distckpt import comm_bytes

    out = {"small": [], "large": []}
    small = []
    for i in range(300):
        t = torch.ones(64)  # small: kept until the backend let go (or exit)
        released(lambda: dist.all_reduce(t), [t])
        kept = any(k is t for k, _ in comm_bytes._kept._items)
        out["small"].append(t._use_count() == 1 or kept)  # let go by the backend, else kept: never dropped first
        small.append(t)
        if i % 30 == 0:
            big = torch.ones(comm_bytes._KEEP_BYTES // 4 + 1)  # large: waited for at once
            released(lambda: dist.all_reduce(big), [big])
            out["large"].append(big._use_count())
    comm_bytes._kept.settle_all()  # what exit does
    out["settled"] = sorted({t._use_count() for t in small})
    return out


def test_released_never_leaves_the_last_reference_to_the_backend():
    """A real gloo all_reduce through ``released``, 300 times: when it returns, a small tensor is either let go
    by the backend or kept by the module (never Python's last reference while gloo's worker holds one); a large
    one has been waited for; after the exit-time settle every tensor's only reference is Python's."""
    for out in run_distributed(_counts_after_release, 2):
        assert all(out["small"])
        assert set(out["large"]) == {1}
        assert out["settled"] == [1]


def test_every_collective_of_the_package_goes_through_comm_bytes():
    """No module but comm.py / comm_bytes.py calls torch's collectives (whose object collectives drop their
    tensors to the worker): the guarantee above covers every collective the library makes."""
    import re
    from pathlib import Path

    import lightning_distckpt

    pattern = re.compile(r"\bdist\.(all_reduce|all_gather\w*|broadcast\w*|barrier|send\w*|recv\w*|isend|irecv|"
                         r"scatter\w*|gather\w*|reduce\w*)\(")
    root = Path(lightning_distckpt.__file__).parent
    calls = [f"{p.relative_to(root)}:{n}" for p in root.rglob("*.py") if p.name not in ("comm.py", "comm_bytes.py")
             for n, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert calls == []


EXIT_SCRIPT = textwrap.dedent("""
    import sys
    import torch.distributed as dist
    from lightning_distckpt.comm import get_comm
    rank, port = int(sys.argv[1]), sys.argv[2]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    comm = get_comm()
    for i in range(200):
        comm.barrier()
        comm.all_gather_object(i)
        comm.broadcast_object({"i": i})
        comm.scatter_object([i, i + 1] if rank == 0 else None)
        comm.gather_from([0, 1], i)
    print("done", rank, flush=True)
    # no destroy_process_group: as a user's program that ends after a save, straight into interpreter exit
""")


@pytest.mark.parametrize("run", range(3))
def test_a_process_ending_right_after_collectives_exits_cleanly(tmp_path, run):
    """Two processes make 1,000 of the library's collectives and end at once: both exit 0 (before, about
    one pair in six aborted at exit with SIGABRT on this machine)."""
    script = tmp_path / "collectives.py"
    script.write_text(EXIT_SCRIPT)
    port = str(free_port())
    env = dict(os.environ, PYTHONFAULTHANDLER="1")
    procs = [subprocess.Popen([sys.executable, str(script), str(r), port], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, env=env) for r in range(2)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    for rank, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0 and f"done {rank}" in out, f"rank {rank} exited {p.returncode}:\n{out[-3000:]}"
