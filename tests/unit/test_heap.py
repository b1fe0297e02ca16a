"""A save under a host-memory budget hands the allocator's freed memory back to the OS when its
background writes are done (``saving/heap.py``: glibc's ``malloc_trim``)."""

import ctypes
import logging
import platform
import threading

import pytest
import torch

import lightning_distckpt as ldc
from lightning_distckpt.saving.heap import release_free_heap

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


@pytest.mark.skipif(not GLIBC, reason="malloc_trim is glibc's")
def test_memory_freed_in_a_thread_goes_back_to_the_os():
    """Blocks a thread allocated, touched and freed stay resident in its arena (the last one,
    still held, keeps free() from shrinking the arena); release_free_heap returns them."""
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    held = []

    def churn():
        blocks = [libc.malloc(64 << 10) for _ in range(400)]  # 25 MiB below the mmap threshold: heap memory
        for b in blocks:
            ctypes.memset(b, 1, 64 << 10)
        for b in blocks[:-1]:
            libc.free(b)
        held.append(blocks[-1])

    t = threading.Thread(target=churn)
    t.start()
    t.join()
    before = _rss_kib()
    assert release_free_heap() is True
    after = _rss_kib()
    libc.free(held[0])
    assert before - after > 16 << 10, (before, after)  # most of the 25 MiB freed went back


def _save(tmp_path, budget):
    sd = {"w": ldc.ShardedTensor.from_rank_offsets("w", torch.arange(1000, dtype=torch.float32))}
    saver = ldc.AsyncSaver(max_staging_bytes=budget)
    saver.save(sd, tmp_path / f"b{budget}").finalize()
    out = ldc.load({"w": ldc.ShardedTensor.from_rank_offsets("w", torch.empty(1000))}, tmp_path / f"b{budget}")
    assert torch.equal(out["w"], torch.arange(1000, dtype=torch.float32))


@pytest.mark.skipif(not GLIBC, reason="malloc_trim is glibc's")
def test_only_a_save_under_a_budget_releases_the_heap(tmp_path, caplog):
    with caplog.at_level(logging.DEBUG, logger="lightning_distckpt.saving.heap"):
        _save(tmp_path, None)
        assert not any("freed heap" in m for m in caplog.messages)
        _save(tmp_path, 1 << 30)
        assert any("freed heap handed back to the OS" in m for m in caplog.messages), caplog.messages
