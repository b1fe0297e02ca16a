"""The background writes of an AsyncSaver yield the CPU to the training: the writing thread runs at
the saver's ``nice`` (Linux, per thread; the caller's thread keeps its own), and with
``io_concurrency`` at most that many tensorstore threads copy and write."""

import os
import threading

import pytest
import torch

import lightning_distckpt as ldc
from lightning_distckpt.saving.async_save import _yield_cpu


@pytest.mark.skipif(not hasattr(os, "setpriority"), reason="per-thread priorities are a Linux feature")
def test_background_thread_lowers_only_its_own_priority():
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    seen = {}

    def work():
        _yield_cpu(mine + 3)
        seen["nice"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert seen["nice"] == mine + 3
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == mine  # the caller's is unchanged


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
