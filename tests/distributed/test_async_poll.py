"""AsyncSaveRequest.poll (what DistCheckpointIO.finalize_if_done asks at every training step): the
ranks are asked on the 1st, 2nd, 4th, 8th and every 16th call only, the other calls return False
without a collective, and the save commits after a True poll. Real gloo group of 2."""

import lightning_distckpt as ldc
import torch
from dist_utils import run_distributed
from lightning_distckpt.storage.layout import is_committed


def _poll_schedule(rank, world, root):
    saver = ldc.AsyncSaver()
    sd = {"w": ldc.ShardedTensor.from_rank_offsets("w", torch.full((4, 4), float(rank)), (0, rank, world))}
    req = saver.save(sd, f"{root}/ck")
    req.wait()  # this rank's writes have finished: every asked poll sees all ranks done
    answers = [req.poll() for _ in range(33)]
    # no call that returned False entered a collective: the next collective pairs up on both ranks
    req.finalize()
    return answers, is_committed(f"{root}/ck")


def test_poll_asks_on_a_sparse_schedule(tmp_path):
    results = run_distributed(_poll_schedule, 2, str(tmp_path))
    asked = [1, 2, 4, 8, 16, 32]
    for answers, committed in results:
        assert [n for n, a in enumerate(answers, 1) if a] == asked
        assert committed
