"""The background writes of an AsyncSaver yield the CPU to the training: the writing thread and
tensorstore's worker threads run at the saver's ``nice`` (Linux, per thread; the caller's thread
keeps its own), and with ``io_concurrency`` at most that many tensorstore threads copy and write."""

import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

import lightning_distckpt as ldc
from lightning_distckpt.saving.priority import yielding_cpu


@pytest.mark.skipif(not hasattr(os, "setpriority"), reason="per-thread priorities are a Linux feature")
def test_background_thread_lowers_only_its_own_priority():
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    seen = {}

    def work():
        with yielding_cpu(mine + 3):
            seen["nice"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert seen["nice"] == mine + 3
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == mine  # the caller's is unchanged


_WORKERS_LOWERED = textwrap.dedent("""
    import os, sys, threading, torch
    import lightning_distckpt as ldc
    from lightning_distckpt.saving.priority import IO_THREAD_NAME

    def workers():
        out = {}
        for task in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{task}/comm") as f:
                    if f.read().strip() == IO_THREAD_NAME:
                        out[int(task)] = os.getpriority(os.PRIO_PROCESS, int(task))
            except OSError:
                pass
        return out

    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    sd = {f"t{i}": ldc.ShardedTensor.from_rank_offsets(f"t{i}", torch.randn(64, 64)) for i in range(8)}
    ldc.save(sd, sys.argv[1] + "/sync")  # tensorstore's workers started by this (the training's) thread
    before = workers()
    assert before and set(before.values()) == {mine}, before
    ldc.AsyncSaver(nice=mine + 3).save(sd, sys.argv[1] + "/async").finalize()
    after = workers()
    # every worker there before the save is lowered (or has exited meanwhile); the caller is not
    assert all(after.get(tid, mine + 3) == mine + 3 for tid in before), (before, after)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == mine
""")


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="thread names and priorities are read from /proc")
def test_tensorstore_workers_started_by_the_training_thread_are_lowered(tmp_path):
    """The workers do most of a background save's CPU work; when the training thread used
    tensorstore first (a load, a synchronous save) they were started at its priority (in a
    subprocess: lowered workers stay lowered, and this test process keeps its own)."""
    if os.getpriority(os.PRIO_PROCESS, 0) > 16:
        pytest.skip("already running at the lowest priorities")
    run = subprocess.run([sys.executable, "-c", _WORKERS_LOWERED, str(tmp_path)], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]


def test_io_concurrency_bounds_the_background_writer(tmp_path):
    saver = ldc.AsyncSaver(io_concurrency=2, nice=0)
    sd = {"w": ldc.ShardedTensor.from_rank_offsets("w", torch.arange(8.0))}
    req = saver.save(sd, tmp_path / "a")
    assert req._prep.options.io_concurrency == 2  # the writer's context; not part of the plan or metadata
    req.finalize()
    out = ldc.load({"w": ldc.ShardedTensor.from_rank_offsets("w", torch.zeros(8))}, tmp_path / "a")
    assert torch.equal(out["w"], torch.arange(8.0))
    req = ldc.AsyncSaver(io_concurrency=64).save(sd, tmp_path / "b")
    assert req._prep.options.io_concurrency == 16  # it only lowers the storage options' concurrency
    req.finalize()


@pytest.mark.parametrize("kwargs", [{"nice": -1}, {"nice": 20}, {"nice": 1.5}, {"io_concurrency": 0}])
def test_bad_priority_or_concurrency_is_refused(kwargs):
    with pytest.raises(ldc.ArgumentError, match=next(iter(kwargs))):
        ldc.AsyncSaver(**kwargs)
