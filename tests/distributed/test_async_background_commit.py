"""AsyncSaver(commit_in_background=True): the background thread commits over a gloo group of the
saver's own while the training thread runs its own collectives; a write failure on one rank is
raised by finalize on every rank and the previous checkpoint stays; a save over a subgroup commits
at finalize as before. Real gloo groups."""

import os
import resource
import signal

import torch
import torch.distributed as dist

import lightning_distckpt as ldc
from dist_utils import run_distributed
from lightning_distckpt.core.errors import SaveFailedError
from lightning_distckpt.storage.layout import is_committed
from test_async_save import loaded, same, state


def _commits_while_training(rank, world, root):
    saver = ldc.AsyncSaver(commit_in_background=True)
    out = {}
    for n in range(3):  # the first save makes the saver's group; the next ones reuse it
        sd = state(rank, world, float(n + 1))
        req = saver.save(sd, f"{root}/ck{n}")
        for v in sd.values():
            if isinstance(v, ldc.ShardedTensor):
                v.data.add_(1000.0)
        total = torch.zeros(1)
        for _ in range(50):  # the training's collectives on the world group, while the commit runs
            t = torch.ones(1)
            dist.all_reduce(t)
            total += t
        req.wait()  # the thread ends only after the commit: committed before finalize is called
        out[n] = {"background": req.commits_in_background, "committed": is_committed(f"{root}/ck{n}"),
                  "reduced": float(total)}
        req.finalize()
        req.finalize()
    out["exact"] = [same(loaded(f"{root}/ck{n}", rank, world), state(rank, world, float(n + 1))) for n in range(3)]
    return out


def test_background_commit_runs_beside_training_collectives(tmp_path):
    for r in run_distributed(_commits_while_training, 2, str(tmp_path), timeout_s=120):
        for n in range(3):
            assert r[n] == {"background": True, "committed": True, "reduced": 100.0}, r
        assert r["exact"] == [True, True, True]


def _failure(rank, world, root):
    good = f"{root}/ck"
    ldc.save(state(rank, world, 1.0), good)
    saver = ldc.AsyncSaver(commit_in_background=True)
    out = {}
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    if rank == 1:  # rank 1's background writes fail (EFBIG, as on a full disk)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))
    try:
        req = saver.save(state(rank, world, 2.0), good)
        try:
            req.finalize()
            out["error"] = None
        except SaveFailedError as e:
            out["error"], out["failures"] = str(e), sorted(e.failures)
        try:
            req.finalize()  # the same error again, without communicating
        except SaveFailedError as e:
            out["again"] = str(e) == out["error"]
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    out["previous"] = same(loaded(good, rank, world), state(rank, world, 1.0))
    saver.save(state(rank, world, 5.0), good).finalize()  # the saver recovers
    out["recovered"] = same(loaded(good, rank, world), state(rank, world, 5.0))
    out["leftovers"] = sorted(n for n in os.listdir(root) if "staging" in n)
    return out


def test_background_commit_failure_raises_everywhere_and_keeps_previous(tmp_path):
    for r in run_distributed(_failure, 2, str(tmp_path), timeout_s=90):
        assert r["error"] is not None and "rank 1" in r["error"] and r["failures"] == [1], r
        assert r["again"] and r["previous"] and r["recovered"] and r["leftovers"] == []


def _subgroup(rank, world, root):
    group = dist.new_group([0, 1])  # every rank makes it; rank 2 saves nothing
    if rank == 2:
        return None
    saver = ldc.AsyncSaver(commit_in_background=True)
    req = saver.save(state(rank, 2, 1.0), f"{root}/sub", process_group=group)
    background = req.commits_in_background
    req.finalize()  # collective over the subgroup, on this thread
    return background, same(loaded_in(group, f"{root}/sub", rank), state(rank, 2, 1.0))


def loaded_in(group, path, rank):
    tmpl = state(rank, 2, 0.0)
    return ldc.load(tmpl, path, process_group=group)


def test_subgroup_save_commits_at_finalize(tmp_path):
    res = run_distributed(_subgroup, 3, str(tmp_path), timeout_s=120)
    assert res[2] is None
    assert res[0] == (False, True) and res[1] == (False, True)


def _new_world(rank, world, root):
    """A saver kept across a torn-down and re-made world group (a second run in the same process)
    makes its commit group again instead of using the destroyed one."""
    saver = ldc.AsyncSaver(commit_in_background=True)
    saver.save(state(rank, world, 1.0), f"{root}/a").finalize()
    dist.destroy_process_group()
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"file://{root}/rendezvous")
    req = saver.save(state(rank, world, 2.0), f"{root}/b")
    req.finalize()
    return req.commits_in_background, same(loaded(f"{root}/b", rank, world), state(rank, world, 2.0))


def test_a_new_world_gets_a_new_commit_group(tmp_path):
    assert run_distributed(_new_world, 2, str(tmp_path), timeout_s=120) == [(True, True), (True, True)]
