"""A rank that dies during a collective save or load: before the save, after the plan (while its own
writes are prepared), during a load, and right after an async save returned (its background writes
in flight, committed by the caller's ``finalize`` or by the background thread). Every surviving rank
gets a CheckpointingError saying a rank may have died (no hang: the group's timeout is far away),
nothing is committed at the target, the checkpoint saved before is intact, and what the failed save
left (a hidden staging directory) is removed by ``clean``.
"""

import os

import pytest
import torch

import lightning_distckpt as ldc
from lightning_distckpt.saving import save_commit
from lightning_distckpt.cli.clean import clean
from dist_utils import die_now, run_distributed


def _state(rank, value, obj=None):
    return {"w": ldc.ShardedTensor.from_rank_offsets("w", torch.full((4,), value), (0, rank, 2)),
            "o": ldc.ShardedObject("o", obj if obj is not None else {"rank": rank}, (2,), (rank,)), "step": value}


def _scenario(rank, world, point, path):
    ldc.save(_state(rank, 1.0), path + "_good")
    try:
        if point == "before_save":  # the survivor waits in the save's first exchange
            if rank == 1:
                die_now(rank)
            ldc.save(_state(rank, 2.0), path)
        elif point == "after_plan":  # rank 1 gone as its writes begin, after the handshake and the plan
            if rank == 1:
                save_commit.write_local = lambda prep: die_now(rank)  # this worker process's own copy
            ldc.save(_state(rank, 2.0), path)
        elif point == "load":
            if rank == 1:
                die_now(rank)
            ldc.load(_state(rank, 0.0), path + "_good")
        else:  # an async save, then the rank is gone with its writes in flight
            saver = ldc.AsyncSaver(commit_in_background=point == "async_background_commit")
            request = saver.save(_state(rank, 2.0), path)
            if rank == 1:
                die_now(rank)
            request.wait()
            saver.finalize()
        return "no error"
    except ldc.CheckpointingError as e:
        return f"CheckpointingError {type(e).__name__}: {e}"
    except Exception as e:  # judged by the test
        return f"other {type(e).__name__}: {e}"


@pytest.mark.parametrize("point", ["before_save", "after_plan", "load", "async_caller_commit", "async_background_commit"])
def test_rank_dies(tmp_path, point):
    path = str(tmp_path / "ck")
    survivor, dead = run_distributed(_scenario, 2, point, path, timeout_s=600)
    assert dead == "died"
    assert survivor.startswith("CheckpointingError") and "may have died" in survivor, survivor
    assert not os.path.exists(path)  # nothing committed (an async save's placeholder is not taken either)
    good = ldc.load(_state(0, 0.0), path + "_good")  # rank 0's part of the earlier checkpoint, exact
    assert torch.equal(good["w"], torch.full((4,), 1.0)) and good["o"] == {"rank": 0} and good["step"] == 1.0
    # what the failed save left is a hidden staging directory that clean removes (no save runs now)
    removed = [a for a in clean(str(tmp_path), 0, False) if a.action == "removed"]
    assert len(removed) == (0 if point in ("load", "before_save") else 1), removed
    assert sorted(os.listdir(tmp_path)) == ["ck_good"]
