"""Comm: tensor broadcasts and point-to-point moves go through it, a failed collective is one
CollectiveError naming the operation and the group, and an agreed error carries each failing
rank's traceback (the first other rank's in its message, the rest as raise sites)."""

import os

import pytest
import torch

import lightning_distckpt as ldc
from lightning_distckpt.comm import _agreed_error, get_comm
from lightning_distckpt.core.errors import TRACEBACK_LIMIT, TRACEBACK_SECTION, CollectiveError, RankFailure
from dist_utils import die_now, run_distributed

HERE = os.path.basename(__file__)


def _raise_on(rank, failing):
    if rank == failing:
        raise ZeroDivisionError(f"rank {rank} cannot go on")  # the line the tracebacks must name


RAISE_LINE = _raise_on.__code__.co_firstlineno + 2


def _build(rank, world, failing):
    def build(key, data, replica_id, flat):
        _raise_on(rank, failing)
        return {"w": ldc.ShardedTensor.from_rank_offsets(key, data, (0, rank, world))}

    def merge(sub):
        _raise_on(rank, failing)
        return sub["w"]

    return build, merge


def _tracebacks_and_tensors(rank, world, root):
    out = {}
    build, _ = _build(rank, world, failing=1)
    try:
        ldc.save({"f": ldc.ShardedTensorFactory("w", torch.ones(2), build, lambda sub: sub["w"])}, f"{root}/bad")
    except ldc.CheckpointingError as e:
        out["save"] = (str(e), {rk: f.traceback for rk, f in e.failures.items()})
    ok_build, _ = _build(rank, world, failing=None)
    ldc.save({"f": ldc.ShardedTensorFactory("w", torch.full((2,), float(rank)), ok_build, lambda sub: sub["w"])},
             f"{root}/good")
    _, merge = _build(rank, world, failing=1)
    try:
        ldc.load({"f": ldc.ShardedTensorFactory("w", torch.zeros(2), ok_build, merge)}, f"{root}/good")
    except ldc.CheckpointingError as e:
        out["load"] = str(e)

    # tensors move in place, over a group that is not the world object
    comm = get_comm(torch.distributed.new_group([0, 1]))
    t = torch.arange(4.0) if rank == 0 else torch.zeros(4)
    comm.broadcast_tensor(t, 0).wait()
    buf = torch.full((3,), float(rank))
    pending = comm.isend(buf, 1, tag=7) if rank == 0 else comm.irecv(buf, 0, tag=7)
    pending.wait()
    out["tensors"] = (t.tolist(), buf.tolist(), pending.is_completed())
    return out


def test_remote_traceback_in_agreed_errors_and_tensor_moves(tmp_path):
    r0, r1 = run_distributed(_tracebacks_and_tensors, 2, str(tmp_path))
    where = f'{HERE}", line {RAISE_LINE}, in _raise_on'
    msg, tracebacks = r0["save"]
    assert "rank 1: ZeroDivisionError: rank 1 cannot go on" in msg
    assert f"{TRACEBACK_SECTION}1 ---" in msg and where in msg and ", in build" in msg, msg
    assert where in tracebacks[1]
    own_msg, own = r1["save"]
    assert TRACEBACK_SECTION not in own_msg and where in own[1]  # its own: the error's __cause__
    assert f"{TRACEBACK_SECTION}1 ---" in r0["load"] and where in r0["load"] and ", in merge" in r0["load"]
    assert TRACEBACK_SECTION not in r1["load"]
    for r in (r0, r1):
        assert r["tensors"] == ([0.0, 1.0, 2.0, 3.0], [0.0, 0.0, 0.0], True)


def test_single_process_tensor_broadcast_is_a_no_op():
    t = torch.arange(3)
    pending = get_comm().broadcast_tensor(t)
    assert pending.is_completed()
    pending.wait()
    assert t.tolist() == [0, 1, 2]


def _dies(rank, world):
    import torch.distributed as dist

    comm = get_comm(dist.new_group([0, 1]))
    comm.barrier()
    if rank == 1:
        die_now(rank)  # gone before sending
    try:
        comm.irecv(torch.zeros(4), 1, tag=3).wait()
        return "no error"
    except Exception as e:
        return f"{type(e).__name__}: {e}"


def test_a_dead_peer_is_one_collective_error_naming_the_operation_and_group():
    msg, dead = run_distributed(_dies, 2)
    assert dead == "died"
    assert msg.startswith("CollectiveError: rank 0: receive of 16 bytes from rank 1 (tag 3) over a group of 2 "
                          "ranks (global ranks 0-1) failed (a rank may have died"), msg


def _deep(n):
    if n == 0:
        raise ValueError("deep down")
    _deeper(n - 1)  # two functions taking turns: Python folds only a frame repeated in a row


def _deeper(n):
    _deep(n)


def test_rank_failure_keeps_the_end_of_a_long_traceback():
    with pytest.raises(ValueError) as e:
        _deep(200)
    f = RankFailure.of(3, e.value)
    assert (f.rank, f.type_name, f.message) == (3, "ValueError", "deep down")
    assert len(f.traceback) < TRACEBACK_LIMIT + 100 and "characters cut" in f.traceback
    assert f.traceback.rstrip().endswith("ValueError: deep down") and f.raised_at.endswith("in _deep")
    assert f.traceback.startswith("[... ")


def test_agreed_message_shows_the_first_remote_traceback_and_the_others_raise_sites():
    tb = 'Traceback (most recent call last):\n  File "/x/train.py", line {}, in step\n    boom()\nOSError: {}\n'
    failures = {rk: RankFailure(rk, "OSError", f"disk {rk}", tb.format(10 * rk, f"disk {rk}")) for rk in (0, 2, 3, 5)}
    err = _agreed_error("save to ck failed", failures, ldc.SaveFailedError, me=0)
    assert isinstance(err, ldc.SaveFailedError) and err.failures == failures
    summary, rest = str(err).split(TRACEBACK_SECTION, 1)
    assert summary == "save to ck failed: rank 0: OSError: disk 0; rank 2: OSError: disk 2; rank 3: OSError: disk 3; " \
                      "rank 5: OSError: disk 5"
    assert rest.startswith('2 ---\nTraceback (most recent call last):\n  File "/x/train.py", line 20, in step')
    assert rest.endswith('--- the other failing ranks raised at: rank 3: File "/x/train.py", line 30, in step; '
                         'rank 5: File "/x/train.py", line 50, in step')
    assert "line 0," not in rest  # this rank's own traceback is the error's cause, not repeated
    # re-agreeing an agreed error does not nest the tracebacks into the message
    again = RankFailure.of(0, err)
    assert again.message == summary


def test_collective_error_is_not_remapped():
    with pytest.raises(CollectiveError, match="^already mapped$"):
        with get_comm()._mapped("op"):
            raise CollectiveError("already mapped")


NO_BACKEND_SCRIPT = """
import sys, torch, torch.distributed as dist
import lightning_distckpt as ldc
dist.init_process_group(store=dist.FileStore(sys.argv[1], 1), rank=0, world_size=1)  # no backend named
assert not torch.accelerator.is_available()
ldc.save({"w": ldc.ShardedTensor.from_rank_offsets("w", torch.arange(4.0))}, sys.argv[2])
out = ldc.load({"w": ldc.ShardedTensor.from_rank_offsets("w", torch.zeros(4))}, sys.argv[2])
assert torch.equal(out["w"], torch.arange(4.0))
print("OK")
"""


def test_a_group_started_without_a_backend_uses_the_cpu_where_there_is_no_accelerator(tmp_path):
    """``init_process_group()`` without a backend (as ``init_device_mesh("cpu", ...)`` calls it) is backend
    "undefined", configured per device ("cpu:gloo"): it was refused as needing an accelerator."""
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", NO_BACKEND_SCRIPT, str(tmp_path / "store"), str(tmp_path / "ck")],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "OK" in run.stdout, run.stderr[-3000:]
