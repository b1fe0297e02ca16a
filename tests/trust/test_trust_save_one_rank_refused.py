"""A save whose state dict only one rank gets wrong (two leaves giving one key) fails on every rank with
that rank's error, sync and async; before, that rank raised alone and the others waited in the save's
first collective until the group timed out. The ranks stay in step: a save after it works."""

import os

import torch

import lightning_distckpt as ldc
from dist_utils import run_distributed
from trust.test_trust_load_one_rank_fails_redteam import _in_step, _outcome

GROUP_TIMEOUT_S = 30  # a rank left waiting gets a CollectiveError, told apart from the agreed error


def _one_rank_refused(rank, world, root):
    bad = {"x/y": torch.zeros(4), "x": {"y": torch.zeros(4)}} if rank == 1 else {"x": {"y": torch.zeros(4)}}
    out = {}
    for mode in ("sync", "async"):
        if not _in_step(out):
            break
        path = os.path.join(root, mode)

        def save():
            request = ldc.save(bad, path, async_save=mode == "async")
            if request is not None:
                request.finalize()
            return "saved"
        out[mode] = _outcome(save)
    again = None
    if _in_step(out):
        ldc.save({"x": {"y": torch.full((4,), 2.0)}}, os.path.join(root, "again"))
        again = ldc.load({"x": {"y": torch.zeros(4)}}, os.path.join(root, "again"))["x"]["y"].tolist()
    return out, again, sorted(os.listdir(root))


def test_a_state_dict_only_one_rank_makes_wrong_fails_every_rank_alike(tmp_path):
    results = run_distributed(_one_rank_refused, 2, str(tmp_path), timeout_s=GROUP_TIMEOUT_S)
    for out, again, listed in results:
        assert again == [2.0] * 4, results  # still in step afterwards
        assert listed == ["again"], listed  # nothing of the refused saves looks like a checkpoint
        for mode in ("sync", "async"):
            kind, message = out[mode]
            assert kind == "ShardingError", (mode, kind, message)
            assert "rank 1:" in message and "would both be stored as 'x/y'" in message, (mode, message)
            assert "rank 0:" not in message, (mode, message)
