"""The gloo groups the library makes for its background work (an async save's commit group, the
tiers' groups) run under the world's timeout, as the caller's own collectives do: a rank that dies
fails them when it fails the training's collectives, not after torch's default 30 minutes. Real gloo
groups, whose timeout is read back from torch."""

import datetime

import torch
import torch.distributed as dist

import lightning_distckpt as ldc
from dist_utils import run_distributed
from lightning_distckpt.comm import group_timeout
from lightning_distckpt.tiers.groups import tier_group
from test_async_save import state

WORLD_TIMEOUT_S = 47.0  # run_distributed's init_process_group timeout; not torch's default of 1,800 s


class _User:
    def quiesce(self) -> None:
        pass


def _timeouts(rank, world, root):
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    saver = ldc.AsyncSaver(commit_in_background=True)
    saver.save(state(rank, world, 1.0), f"{root}/a").finalize()
    user = _User()
    tiers = tier_group(None, user)
    return {"world": backend.options._timeout,
            "commit": group_timeout(saver._commit_group[1]),
            "tiers": group_timeout(tiers),
            "read_back": group_timeout()}


def test_background_groups_take_the_worlds_timeout(tmp_path):
    want = datetime.timedelta(seconds=WORLD_TIMEOUT_S)
    for got in run_distributed(_timeouts, 2, str(tmp_path), timeout_s=WORLD_TIMEOUT_S):
        assert got == {"world": want, "commit": want, "tiers": want, "read_back": want}


def test_no_process_group_no_timeout():
    assert not dist.is_initialized()
    assert group_timeout() is None  # new_group would then use torch's own default
