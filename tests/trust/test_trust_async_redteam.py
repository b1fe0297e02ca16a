"""Red team: async saves (``AsyncSaver``, ``async_save=True``, Fabric's ``async_save: true``) under
interruptions, threads, forks and odd tensors: what a red-team probe found.

* **Ctrl-C while a save waited for the previous one** (``saver.save`` / ``saver.finalize`` joining its
  background writes): the saver forgot the request before waiting, and CPython 3.11's interrupted
  ``Thread.join`` marks the still-running thread stopped (so ``done()`` said True). A caller handling
  Ctrl-C by saving a last checkpoint then had that save copy its state into the staging pool the
  first save's thread was still writing from: the first checkpoint committed with the later values
  (checksums right, no error anywhere). Now the request stays pending until it ends (an event set by
  the thread, not ``is_alive``), and the next save waits for it.
* **Two threads finalizing one save** (a checkpoint-manager thread and the next ``saver.save``): both
  passed the "already finalized" check while waiting, both committed; the second commit swapped in
  what was left of the staging directory, so the target became an empty directory (the new checkpoint
  and the one it replaced both lost) while both calls returned as committed. Now one call commits and
  the other waits for it and sees its outcome.
* **``fabric.load(path)`` right after ``fabric.save(path)`` with ``async_save: true``**: the load opened
  the path before the pending save committed, then committed it (its ``load_sharded`` waits) and read
  on: "replaced while being read" when an older checkpoint was there, "an empty directory" (the name's
  placeholder) when none was. Now the Fabric strategies' load commits a pending save first.
* **A rank whose staged shards are all empty** (a model with a zero-size buffer saved by two DDP ranks:
  balanced writes give the 0-byte tensor to rank 1 alone): every async save failed on
  ``AssertionError: StagingPool.prepare sized the pool for the plan``, which a synchronous save of the
  same state never raises. Empty shards now take no pool memory.
* **A forked child using its parent's in-flight request** (``req.finalize()`` or ``saver.save`` in a
  ``fork``-started worker): the child committed the parent's checkpoint (the parent then reported
  "commit failed, nothing was committed" for a committed save and left a staging directory), or, with
  the writes still running, removed the parent's staging directory under its writer. Now only the
  process that started a save finalizes it; a child's copy of the saver has nothing pending.
* **A meta tensor in an async save** failed on "pin_memory=True requires a CUDA ... backend" on a
  CPU-only host, not on the synchronous save's "Cannot copy out of meta tensor"; now on the same error.
  (Under a staging budget it is still refused as an accelerator shard the budget cannot fit: the budget
  tests use meta tensors to stand for accelerator ones.)

Found sound (and kept here where cheap): mutating, resizing or deleting the saved tensors once ``save``
returned (without ``background_snapshot``); non-contiguous, 0-dim, conjugated, expanded, views sharing
one storage, bool and bfloat16 shards in every staging mode; hostile ``max_staging_bytes`` values (also
in the YAML config); a background write failing on one rank (``tests/distributed/test_async_save.py``);
a process exiting with a group-of-one save in flight (committed at exit); DataLoader-style forked
workers exiting while a save is in flight (they commit nothing of the parent's).

Interleavings are made exact by holding the background writes on an event, opened (or a Ctrl-C sent)
once the threads of interest have called ``AsyncSaveRequest.wait``: no timing is relied on.
"""

import json
import os
import signal
import threading

import pytest
import torch
from dist_utils import run_distributed
from script_ranks import run_ranks, script_env

import lightning_distckpt as ldc
from lightning_distckpt.core.errors import SaveFailedError
from lightning_distckpt.saving import async_request
from lightning_distckpt.saving.async_request import AsyncSaveRequest
from lightning_distckpt.storage.staging import is_staging_dir

HANG_GUARD_S = 60


class WriteGate:
    """Holds the background writes (of ``target`` only, when given) until ``open`` is set."""

    def __init__(self, monkeypatch, target=None):
        self.open = threading.Event()
        real = async_request.write_local

        def held(prep):
            if target is None or prep.target == str(target):
                assert self.open.wait(HANG_GUARD_S), "the test never opened the gate"
            return real(prep)

        monkeypatch.setattr(async_request, "write_local", held)


class WaitCalls:
    """Marks each call of ``AsyncSaveRequest.wait`` (``finalize`` waits for the writes through it):
    ``entered(n)`` is set once it has been called ``n`` times, on any thread."""

    def __init__(self, monkeypatch):
        self._lock, self._calls, self._events = threading.Lock(), 0, {}
        real = AsyncSaveRequest.wait

        def wait(req):
            with self._lock:
                self._calls += 1
                event = self.entered(self._calls)
            event.set()
            return real(req)

        monkeypatch.setattr(AsyncSaveRequest, "wait", wait)

    def entered(self, n):
        return self._events.setdefault(n, threading.Event())


class CtrlC:
    """Ctrl-C for this (the main) thread once ``after`` is set: SIGINT, sent again until its handler has run
    (a signal that arrives as the thread is about to block is handled only when it wakes), which raises
    KeyboardInterrupt the first time only."""

    def __init__(self, after):
        self.raised, main = threading.Event(), threading.get_ident()
        self.previous = signal.signal(signal.SIGINT, self._handler)

        def send():
            if after.wait(HANG_GUARD_S):
                for _ in range(HANG_GUARD_S * 100):
                    signal.pthread_kill(main, signal.SIGINT)
                    if self.raised.wait(0.01):
                        return

        self.sender = threading.Thread(target=send, daemon=True)
        self.sender.start()

    def _handler(self, signum, frame):
        if not self.raised.is_set():
            self.raised.set()
            raise KeyboardInterrupt

    def restore(self):
        self.sender.join(HANG_GUARD_S)  # no SIGINT after this: the previous handler is back
        signal.signal(signal.SIGINT, self.previous)


def then(event, action):
    """``action()`` on a thread of its own once ``event`` is set (not at all past the hang guard)."""
    threading.Thread(target=lambda: event.wait(HANG_GUARD_S) and action(), daemon=True).start()


def _w(t):
    return {"w": ldc.ShardedTensor.from_rank_offsets("w", t)}


def _read_w(path, n=1024):
    return ldc.load(_w(torch.zeros(n)), path)["w"]


def test_ctrl_c_while_the_next_save_waits_keeps_the_save_pending_and_its_pool(tmp_path, monkeypatch):
    gate, waits = WriteGate(monkeypatch, tmp_path / "ck1"), WaitCalls(monkeypatch)
    saver = ldc.AsyncSaver(commit_in_background=True)  # as DistCheckpointIO makes it
    w = torch.full((1024,), 1.0)
    req1 = saver.save(_w(w), tmp_path / "ck1")
    ctrl_c = CtrlC(after=waits.entered(1))
    try:
        w.fill_(2.0)
        with pytest.raises(KeyboardInterrupt):
            saver.save(_w(w), tmp_path / "ck2")  # finalizes ck1 first: Ctrl-C while it waits
    finally:
        ctrl_c.restore()
    # before: pending None and done() True while ck1's thread still waited to write from the pool
    assert saver.pending is req1 and not req1.done() and not req1.finalized
    # The caller handles Ctrl-C by saving once more: that save waits for ck1 before reusing the pool.
    then(waits.entered(2), gate.open.set)
    w.fill_(3.0)
    saver.save(_w(w), tmp_path / "final")
    gate.open.set()
    saver.finalize()
    assert req1.finalized and saver.pending is None
    assert torch.equal(_read_w(tmp_path / "ck1"), torch.full((1024,), 1.0))  # before: 3.0, the later copy
    assert torch.equal(_read_w(tmp_path / "final"), torch.full((1024,), 3.0))
    assert not (tmp_path / "ck2").exists()


def test_two_threads_finalizing_one_save_commit_it_once(tmp_path, monkeypatch):
    path = tmp_path / "ck"
    ldc.save(_w(torch.full((1024,), 0.0)), path)  # the checkpoint the save replaces
    gate, waits = WriteGate(monkeypatch), WaitCalls(monkeypatch)
    commits = []
    real_finalize_save = async_request.finalize_save

    def counted(prep, result):
        commits.append(prep.target)
        return real_finalize_save(prep, result)

    monkeypatch.setattr(async_request, "finalize_save", counted)
    req = ldc.AsyncSaver().save(_w(torch.full((1024,), 1.0)), path)
    outcomes = []

    def finalize():
        try:
            req.finalize()
            outcomes.append("committed")
        except BaseException as e:  # noqa: BLE001 - reported below
            outcomes.append(f"{type(e).__name__}: {e}")

    threads = [threading.Thread(target=finalize) for _ in range(2)]
    for t in threads:
        t.start()
    then(waits.entered(2), gate.open.set)  # both past the "already finalized" check, waiting for the writes
    for t in threads:
        t.join(HANG_GUARD_S)
    assert outcomes == ["committed", "committed"]
    assert commits == [str(path)]  # before: two commits of one staging directory
    assert torch.equal(_read_w(path), torch.full((1024,), 1.0))  # before, often: "an empty directory"
    assert not [n for n in os.listdir(tmp_path) if is_staging_dir(n)]


# Two ranks under FabricDistCheckpointStrategy with async saves. A committed checkpoint at `path`,
# then a save of new values to the same path whose background writes are held until this rank's load
# has either committed the pending save (finalize) or opened the checkpoint (the older one, before).
FABRIC_LOAD = r'''
import json, os, sys, threading
from datetime import timedelta
import torch
from lightning.fabric import Fabric
from lightning_distckpt.lightning import FabricDistCheckpointStrategy
from lightning_distckpt.lightning import checkpoint_io as cio
from lightning_distckpt.saving import async_request

folder, out = sys.argv[1], sys.argv[2]
strategy = FabricDistCheckpointStrategy(timeout=timedelta(seconds=30), checkpoint={"async_save": True})
fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
fabric.launch()
torch.manual_seed(0)
model = fabric.setup(torch.nn.Linear(8, 8))
path = os.path.join(folder, "last")
fabric.save(path, {"model": model, "step": 1})
fabric.strategy.checkpoint_io.wait()

gate = threading.Event()
real_write, real_finalize, real_open = async_request.write_local, async_request.AsyncSaveRequest.finalize, cio.open_checkpoint


def held_write(prep):
    assert gate.wait(60), "the load neither finalized the save nor opened the checkpoint"
    return real_write(prep)


def finalize(self):
    gate.set()
    return real_finalize(self)


def opened(*args, **kwargs):
    try:
        return real_open(*args, **kwargs)
    finally:
        gate.set()


async_request.write_local, async_request.AsyncSaveRequest.finalize, cio.open_checkpoint = held_write, finalize, opened
with torch.no_grad():
    for p in model.parameters():
        p.add_(1.0)
saved = {k: v.clone() for k, v in model.state_dict().items()}
fabric.save(path, {"model": model, "step": 2})  # returns with its writes held
with torch.no_grad():
    for p in model.parameters():
        p.zero_()
state, res = {"model": model, "step": 0}, {}
try:
    fabric.load(path, state)
    res["load"] = "ok"
except Exception as e:
    res["load"] = f"{type(e).__name__}: {e}"
gate.set()
res["step"] = state["step"]
res["values"] = all(torch.equal(v, saved[k]) for k, v in model.state_dict().items())
with open(f"{out}.rank{fabric.global_rank}.json", "w") as f:
    json.dump(res, f)
'''


def test_fabric_load_right_after_an_async_save_of_the_same_path(tmp_path):
    script = tmp_path / "loop.py"
    script.write_text(FABRIC_LOAD)
    code, output = run_ranks(str(script), [str(tmp_path), str(tmp_path / "out")], script_env(), 2, timeout=180)
    for rank in range(2):
        path = tmp_path / f"out.rank{rank}.json"
        assert path.is_file(), f"rank {rank} wrote no results (exit {code}):\n{output[-6000:]}"
        res = json.loads(path.read_text())
        # before: "CheckpointingError: ... was replaced while being read (a newer save committed to the same path)"
        assert res == {"load": "ok", "step": 2, "values": True}, (rank, res)


def _empty_buffer(rank, world, root):
    """A replicated model with a zero-size buffer: balanced writes give rank 1 the empty tensor alone."""
    out = {}
    for mode in ("sync", "async"):
        sd = {"w": torch.ones(64, 64), "empty": torch.zeros(0, 3), "step": 1}
        try:
            if mode == "sync":
                ldc.save(sd, f"{root}/{mode}")
            else:
                ldc.save(sd, f"{root}/{mode}", async_save=True).finalize()
            got = ldc.load_plain_tensors(f"{root}/{mode}")
            out[mode] = (tuple(got["empty"].shape), torch.equal(got["w"], torch.ones(64, 64)))
        except SaveFailedError as e:
            out[mode] = str(e).splitlines()[0]
    return out


def test_an_async_save_of_a_rank_with_only_empty_shards(tmp_path):
    for res in run_distributed(_empty_buffer, 2, str(tmp_path), timeout_s=60):
        assert res["sync"] == ((0, 3), True)
        # before: "... rank 1: AssertionError: StagingPool.prepare sized the pool for the plan"
        assert res["async"] == ((0, 3), True), res["async"]


@pytest.mark.parametrize("how", [{}, {"background_snapshot": True}, {"budget": 0}], ids=["plain", "bg", "budget0"])
def test_empty_shards_alone_save_async_in_every_mode(tmp_path, how):
    sd = {"e": ldc.ShardedTensor.from_rank_offsets("e", torch.zeros(0, 4)),
          "f": ldc.ShardedTensor.from_rank_offsets("f", torch.zeros(3, 0, dtype=torch.bfloat16))}
    saver = ldc.AsyncSaver(max_staging_bytes=how.get("budget"))
    saver.save(sd, tmp_path / "ck", background_snapshot=how.get("background_snapshot", False)).finalize()
    got = ldc.load_plain_tensors(tmp_path / "ck")
    assert got["e"].shape == (0, 4) and got["f"].shape == (3, 0) and got["f"].dtype == torch.bfloat16


def _in_fork(fn):
    """``fn()`` run in a forked child of this process (as a ``fork``-started worker is): what it
    returned, or the exception it raised, as text."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report through the pipe, leave at once (no pytest teardown here)
        try:
            os.close(read)
            try:
                text = f"returned {fn()!r}"
            except BaseException as e:  # noqa: BLE001 - the report
                text = f"{type(e).__name__}: {e}"
            os.write(write, text.encode()[:8000])
        finally:
            os._exit(0)
    os.close(write)
    chunks = []
    while True:
        chunk = os.read(read, 8192)
        if not chunk:
            break
        chunks.append(chunk)
    os.close(read)
    os.waitpid(pid, 0)
    return b"".join(chunks).decode()


@pytest.mark.parametrize("written", [False, True], ids=["writing", "written"])
def test_a_forked_child_leaves_its_parents_save_alone(tmp_path, monkeypatch, written):
    gate = WriteGate(monkeypatch)
    saver = ldc.AsyncSaver()
    req = saver.save(_w(torch.full((1024,), 1.0)), tmp_path / "ck")
    if written:
        gate.open.set()
        req.wait()
    staging = sorted(n for n in os.listdir(tmp_path) if is_staging_dir(n))  # written: the parent's, whole
    assert len(staging) == written
    child = _in_fork(lambda: (saver.pending, req.finalize()))
    # before: "returned (<...AsyncSaveRequest...>, None)" (written: the child committed the parent's save) or
    # "SaveFailedError: ... the background write ended without a result" (writing: it removed the staging dir)
    assert child.startswith("CheckpointingError: ") and "cannot finalize it" in child, child
    assert _in_fork(lambda: saver.pending) == "returned None"
    assert sorted(n for n in os.listdir(tmp_path) if is_staging_dir(n)) == staging  # untouched by the child
    assert not (tmp_path / "ck").exists()
    gate.open.set()
    req.finalize()  # before (written): "commit failed, nothing was committed" though the child had committed it
    assert torch.equal(_read_w(tmp_path / "ck"), torch.full((1024,), 1.0))
    assert not [n for n in os.listdir(tmp_path) if is_staging_dir(n)]


@pytest.mark.parametrize("snapshot", [False, True], ids=["plain", "bg"])
def test_a_meta_tensor_fails_an_async_save_as_it_fails_a_sync_one(tmp_path, snapshot):
    sd = {"w": ldc.ShardedTensor.from_rank_offsets("w", torch.empty(4, device="meta"))}
    with pytest.raises(SaveFailedError, match="Cannot copy out of meta tensor"):
        ldc.save(sd, tmp_path / "sync")
    # before, on a CPU-only host: "pin_memory=True requires a CUDA or other accelerator backend"
    with pytest.raises(SaveFailedError, match="Cannot copy out of meta tensor"):
        ldc.AsyncSaver().save(sd, tmp_path / "async", background_snapshot=snapshot).finalize()
    assert not (tmp_path / "async").exists()


def _odd(base):
    """Shards of every odd make, from one storage where they can share it."""
    flat = torch.arange(24.0) + base
    cplx = torch.complex(flat[:4], -flat[:4])
    return {
        "t": flat[:12].reshape(3, 4).t(), "scalar": flat[5].clone().reshape(()),
        "view_a": flat[:6], "view_b": flat[4:10],
        "expanded": flat[:4].expand(3, 4), "conj": cplx.conj(), "neg": cplx.conj().imag, "flip": flat[:6].flip(0),
        "bool": flat[:5] > base + 2, "bf16": flat[:7].to(torch.bfloat16),
    }


@pytest.mark.parametrize("how", [{}, {"background_snapshot": True}, {"budget": 0}, {"budget": 64}],
                         ids=["plain", "bg", "budget0", "budget64"])
def test_odd_tensors_and_later_changes_save_exactly(tmp_path, how):
    """Found sound: the checkpoint holds the values at ``save``, whatever the caller does to its tensors
    once ``save`` returned (or ``wait_snapshot()`` did)."""
    src = _odd(1.0)
    want = {k: v.resolve_conj().resolve_neg().clone() for k, v in src.items()}
    sd = {k: ldc.ShardedTensor.from_rank_offsets(k, v) for k, v in src.items()}
    saver = ldc.AsyncSaver(max_staging_bytes=how.get("budget"), writer_bytes=0)
    req = saver.save(sd, tmp_path / "ck", background_snapshot=how.get("background_snapshot", False))
    req.wait_snapshot()
    for name, t in src.items():  # changed in place, resized, then dropped
        if name == "scalar":
            t.resize_(0)
        elif t.dtype.is_floating_point and name != "expanded":
            t.add_(100.0)
    del src, sd
    req.finalize()
    got = ldc.load_plain_tensors(tmp_path / "ck")
    assert {k: (got[k].dtype, got[k].shape) for k in want} == {k: (v.dtype, v.shape) for k, v in want.items()}
    assert all(torch.equal(got[k], want[k]) for k in want), {k: (got[k], want[k]) for k in want}
