"""Async saves whose snapshot is copied by the background thread (``background_snapshot``): what the
caller may do when, the values saved, and a promise broken (a tensor changed before its copy) failing
the save on every rank with nothing committed. The background copy is held back by a gate the test
opens (an event, never the clock), so "before the copy" is certain."""

import threading

import pytest
import torch

import lightning_distckpt as ldc
from dist_utils import run_distributed
from lightning_distckpt.core.errors import ArgumentTypeError, SaveFailedError
from lightning_distckpt.saving import background_snapshot
from lightning_distckpt.storage.layout import is_committed


class Gate:
    """Holds the background copy until opened; says when the copy has started waiting."""

    def __init__(self, monkeypatch):
        self.open, self.reached = threading.Event(), threading.Event()
        real = background_snapshot.copy_in

        def gated(placed, ready=None):
            self.reached.set()
            assert self.open.wait(60), "the test never opened the gate"
            real(placed, ready)

        monkeypatch.setattr(background_snapshot, "copy_in", gated)


def state(value):
    return {"w": ldc.ShardedTensor.from_rank_offsets("w", torch.full((64, 8), value)),
            "b": ldc.ShardedTensor.from_rank_offsets("b", torch.full((8,), value)), "step": int(value)}


def read(path):
    tmpl = state(0.0)
    return ldc.load(tmpl, path)


def test_the_copy_waits_for_the_caller_and_saves_the_state_as_of_save(tmp_path, monkeypatch):
    gate = Gate(monkeypatch)
    saver = ldc.AsyncSaver()
    sd = state(1.0)
    req = saver.save(sd, tmp_path / "ck", background_snapshot=True)
    assert gate.reached.wait(60) and not req.snapshot_done()
    gate.open.set()
    req.wait_snapshot()
    assert req.snapshot_done()
    for v in (sd["w"], sd["b"]):
        v.data.add_(100.0)  # allowed now: the copy is taken
    req.finalize()
    out = read(tmp_path / "ck")
    assert torch.equal(out["w"], torch.full((64, 8), 1.0)) and torch.equal(out["b"], torch.full((8,), 1.0))
    assert req.background_snapshot_s > 0


def test_a_tensor_changed_before_its_copy_fails_the_save(tmp_path, monkeypatch):
    ldc.save(state(5.0), tmp_path / "ck")  # an earlier checkpoint at the same place survives
    gate = Gate(monkeypatch)
    sd = state(1.0)
    req = ldc.AsyncSaver().save(sd, tmp_path / "ck", background_snapshot=True)
    assert gate.reached.wait(60)
    sd["w"].data.mul_(3.0)  # the promise broken: changed before wait_snapshot()
    gate.open.set()
    with pytest.raises(SaveFailedError, match=r"changed in place while the background snapshot copied them: 'w'"):
        req.finalize()
    assert torch.equal(read(tmp_path / "ck")["w"], torch.full((64, 8), 5.0))


def test_only_the_selected_shards_wait(tmp_path, monkeypatch):
    gate = Gate(monkeypatch)
    sd = state(1.0)
    later = sd["w"].data
    req = ldc.AsyncSaver().save(sd, tmp_path / "ck", background_snapshot=lambda t: t.data_ptr() == later.data_ptr())
    assert gate.reached.wait(60)
    sd["b"].data.add_(100.0)  # copied before save returned: free to change
    gate.open.set()
    req.finalize()
    out = read(tmp_path / "ck")
    assert torch.equal(out["b"], torch.full((8,), 1.0)) and torch.equal(out["w"], torch.full((64, 8), 1.0))


def test_under_a_staging_budget_only_the_staged_wave_waits(tmp_path, monkeypatch):
    """What does not fit the budget is written before save returns (from the caller's memory); the
    staged wave is copied by the thread: the caller may change the first at once, the second after
    wait_snapshot()."""
    gate = Gate(monkeypatch)
    sd = state(1.0)  # w: 2 KiB, b: 32 B
    saver = ldc.AsyncSaver(max_staging_bytes=1024, writer_bytes=0)
    req = saver.save(sd, tmp_path / "ck", background_snapshot=True,
                     storage=ldc.StorageOptions(pack_max_bytes=0))  # w and b apart, not in one pack
    assert req.waves == 2 and gate.reached.wait(60)
    sd["w"].data.add_(100.0)  # written before save returned
    gate.open.set()
    req.wait_snapshot()
    sd["b"].data.add_(100.0)
    req.finalize()
    out = read(tmp_path / "ck")
    assert torch.equal(out["w"], torch.full((64, 8), 1.0)) and torch.equal(out["b"], torch.full((8,), 1.0))
    assert saver.peak_staging_bytes <= 1024


def test_arguments_are_checked(tmp_path):
    with pytest.raises(ArgumentTypeError, match="needs async_save"):
        ldc.save(state(1.0), tmp_path / "a", background_snapshot=True)
    with pytest.raises(ArgumentTypeError, match="background_snapshot must be"):
        ldc.save(state(1.0), tmp_path / "b", async_save=True, background_snapshot="yes")
    assert not is_committed(str(tmp_path / "a")) and not is_committed(str(tmp_path / "b"))


def _one_rank_breaks_the_promise(rank, world, root):
    opened = threading.Event()
    real = background_snapshot.copy_in

    def gated(placed, ready=None):
        assert opened.wait(60)
        real(placed, ready)

    background_snapshot.copy_in = gated  # this process's own copy: released below
    try:
        saver = ldc.AsyncSaver()
        sd = {"w": ldc.ShardedTensor.from_rank_offsets("w", torch.full((8, 4), 1.0 + rank), (0, rank, world)), "step": 1}
        req = saver.save(sd, f"{root}/ck", background_snapshot=True)
        if rank == 1:
            sd["w"].data.zero_()
        opened.set()
        try:
            req.finalize()
        except SaveFailedError as e:
            return str(e)
        return None
    finally:
        background_snapshot.copy_in = real


def test_one_rank_breaking_the_promise_fails_the_save_on_every_rank(tmp_path):
    errors = run_distributed(_one_rank_breaks_the_promise, 2, str(tmp_path))
    assert all(e is not None and "rank 1" in e and "'w'" in e for e in errors), errors
    assert not is_committed(str(tmp_path / "ck"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_shards_are_copied_on_a_stream_of_their_own(tmp_path):
    """The copy waits for what the caller's stream queued before save (the kernels writing the values)
    and overlaps what it queues after; after wait_snapshot() the caller's changes are not saved."""
    w = torch.zeros(1024, 1024, device="cuda")
    w.add_(7.0)  # queued on the caller's stream before save: must be in the checkpoint
    sd = {"w": ldc.ShardedTensor.from_rank_offsets("w", w), "step": 1}
    saver = ldc.AsyncSaver()
    req = saver.save(sd, tmp_path / "ck", background_snapshot=True)
    req.wait_snapshot()
    w.mul_(0.0)
    req.finalize()
    assert saver.pin_memory is None and all(b.is_pinned() for b in saver.staging_buffers().values())
    assert torch.equal(ldc.load({"w": ldc.ShardedTensor.from_rank_offsets("w", torch.empty(1024, 1024))},
                                tmp_path / "ck")["w"], torch.full((1024, 1024), 7.0))
