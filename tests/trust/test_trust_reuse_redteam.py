"""Red team: state reused across saves (the plan cache, the async staging pool, background snapshots).

A checkpoint holds exactly the values the state had at ``save`` (or the save fails clearly, on every
rank, the previous checkpoint untouched): never another key's bytes, never a shape or dtype other
than the data's, whatever changed between two saves that reuse a plan. The background copy is held
back by a gate the test opens (an event, never the clock)."""

import threading

import pytest
import torch
from dist_utils import run_distributed

import lightning_distckpt as ldc
from lightning_distckpt.core.errors import SaveFailedError, ShardingError
from lightning_distckpt.saving import background_snapshot
from lightning_distckpt.saving.save import SavePlanCache


def _w(t):
    return {"w": ldc.ShardedTensor.from_rank_offsets("w", t)}


def _read_w(path, shape=(4, 4), dtype=torch.float32):
    return ldc.load(_w(torch.zeros(shape, dtype=dtype)), path)["w"]


def _retype(t):
    t.data = t.data.double()


def _reshape_same_numel(t):
    t.set_(torch.arange(100.0, 116.0).reshape(2, 8))


def _grow(t):
    t.set_(torch.arange(100.0, 120.0).reshape(5, 4))


@pytest.mark.parametrize("change", [_retype, _reshape_same_numel, _grow], ids=["dtype", "same-numel", "grown"])
def test_a_kept_sharded_tensor_whose_data_changed_is_refused(tmp_path, change):
    """A sharded state dict kept from save to save (its ShardedTensor declares (4, 4) float32) whose
    tensor was changed since: before, the cached plan wrote float64 bytes under a float32 index (a
    committed checkpoint no load could read, replacing the good one), silently reshaped (2, 8) into
    (4, 4), or raised a bare RuntimeError after the ranks had agreed to write."""
    t = torch.arange(16.0).reshape(4, 4).clone()
    sd, cache, path = _w(t), SavePlanCache(), tmp_path / "ck"
    ldc.save(sd, path, plan_cache=cache)
    change(t)
    declared = r"'w' on rank 0: its data is now .* declares torch.float32 of shape \(4, 4\)"
    with pytest.raises(ShardingError, match=declared):
        ldc.save(sd, path, plan_cache=cache)
    assert torch.equal(_read_w(path), torch.arange(16.0).reshape(4, 4))  # the previous checkpoint, whole
    sd = _w(t)  # made anew: saved as it now is
    ldc.save(sd, path, plan_cache=cache)
    assert torch.equal(_read_w(path, tuple(t.shape), t.dtype), t)


def test_a_sharded_tensor_without_data_is_refused_before_writing(tmp_path):
    """A metadata-only ShardedTensor (a load template) given to save: before, a bare AttributeError from
    the rank that was to write it, after the ranks had agreed to write."""
    st = ldc.ShardedTensor(key="w", data=None, dtype=torch.float32, local_shape=(4,), global_shape=(4,),
                           global_offset=(0,))
    with pytest.raises(ShardingError, match="'w' on rank 0: a ShardedTensor without data cannot be saved"):
        ldc.save({"w": st}, tmp_path / "ck")
    assert not (tmp_path / "ck").exists()


def _one_rank_changes_kept_state(rank, world, root, how):
    t = torch.full((4, 4), float(rank))
    sd = {"tp": ldc.ShardedTensor.from_rank_offsets("tp", t, (0, rank, world))}
    saver = ldc.AsyncSaver()
    saver.save(sd, f"{root}/ck").finalize()
    if rank == 1:  # rank 0's records are unchanged, so is rank 1's declaration: the plan would be reused
        if how == "dtype":
            t.data = t.data.double()
        else:
            t.set_(torch.ones(5, 4))
    try:
        saver.save(sd, f"{root}/ck")
        err = None
    except ShardingError as e:
        err = (str(e), sorted(e.failures))
    tmpl = {"tp": ldc.ShardedTensor.from_rank_offsets("tp", torch.zeros(4, 4), (0, rank, world))}
    return err, ldc.load(tmpl, f"{root}/ck")["tp"].tolist()


@pytest.mark.parametrize("how", ["dtype", "grown"])
def test_one_rank_changing_a_kept_tensor_fails_every_rank_before_writing(tmp_path, how):
    """On one rank only, under a cached plan: before, a dtype change committed an unreadable pack, and a
    grown tensor failed rank 1 alone after the handshake, its collectives then out of step with rank 0's."""
    for rank, (err, values) in enumerate(run_distributed(_one_rank_changes_kept_state, 2, str(tmp_path), how,
                                                         timeout_s=60)):
        assert err is not None and err[1] == [1] and "'tp' on rank 1" in err[0], err
        assert values == [[float(rank)] * 4] * 4  # the previous checkpoint is intact


class Gate:
    """Holds the background copy until opened."""

    def __init__(self, monkeypatch):
        self.open = threading.Event()
        real = background_snapshot.copy_in

        def gated(placed, ready=None):
            assert self.open.wait(60), "the test never opened the gate"
            real(placed, ready)

        monkeypatch.setattr(background_snapshot, "copy_in", gated)


@pytest.mark.parametrize("replacement", [(4, 4), (4,)], ids=["same-shape", "broadcast"])
def test_data_replaced_before_the_background_copy_fails_the_save(tmp_path, monkeypatch, replacement):
    """``t.data = other`` counts no version: before, the background copy read the other tensor (a
    step later's values; a (4,) one broadcast into the (4, 4) buffer) and committed it."""
    path = tmp_path / "ck"
    t = torch.arange(16.0).reshape(4, 4).clone()
    ldc.save(_w(t), path)
    gate = Gate(monkeypatch)
    saver = ldc.AsyncSaver()
    req = saver.save(_w(t), path, background_snapshot=True)
    t.data = torch.full(replacement, -1.0)  # the caller's next step, before wait_snapshot()
    gate.open.set()
    with pytest.raises(SaveFailedError, match=r"changed in place while the background snapshot copied them: 'w'"):
        req.finalize()
    assert torch.equal(_read_w(path), torch.arange(16.0).reshape(4, 4))
    t.data = torch.full((4, 4), -2.0)
    req = saver.save(_w(t), path, background_snapshot=True)  # a caller that waits as promised
    req.wait_snapshot()
    t.data = torch.zeros(4, 4)
    req.finalize()
    assert torch.equal(_read_w(path), torch.full((4, 4), -2.0))


def _layout(rank, world, v, order=("rep", "tp", "flat"), rep_replica=None, view=False):
    """Replicated, TP-split and flattened shards (plus one object each) holding values from ``v``."""
    base = torch.arange(32.0) + v
    rep = base.reshape(4, 8).t() if view else base[:32].reshape(8, 4).clone()  # (8, 4): non-contiguous or not
    tp = torch.arange(8.0).reshape(2, 4) + v + 100 * rank
    big = torch.arange(40.0) + v  # "flat" a view at a storage offset of another tensor
    parts = {
        "rep": ldc.ShardedTensor.from_rank_offsets("rep", rep, replica_id=rank if rep_replica is None else rep_replica),
        "tp": ldc.ShardedTensor.from_rank_offsets("tp", tp, (0, rank, world)),
        "flat": ldc.ShardedTensor.from_rank_offsets("flat", big[8 + 4 * rank:12 + 4 * rank], local_shape=(8,),
                                                    flattened_range=slice(4 * rank, 4 * rank + 4)),
    }
    sd = {k: parts[k] for k in order}
    sd["obj"] = ldc.ShardedObject("obj", {"rank": rank, "v": v}, (world,), (rank,))
    return sd


def _expected(rank, world, v, view=False):
    base = torch.arange(32.0) + v
    return {"rep": base.reshape(4, 8).t() if view else base.reshape(8, 4),
            "tp": torch.cat([torch.arange(8.0).reshape(2, 4) + v + 100 * r for r in range(world)]),
            "flat": torch.arange(8.0, 16.0) + v, "obj": {"rank": rank, "v": v}}


def _one_rank_changes_under_cache(rank, world, root):
    cache, out, moved = SavePlanCache(), [], ("flat", "tp", "rep")
    steps = [  # (value, rank 1's own change): rank 0 saves the same layout every time
        (1.0, {}), (2.0, {}),
        (3.0, {"order": moved}),  # rank 1's keys in another order: its sources move
        (4.0, {"order": moved, "rep_replica": 2}),  # still not the main replica: same plan, reused
        (5.0, {"order": moved, "rep_replica": 2, "view": True}),  # new tensors: a non-contiguous view
    ]
    for v, change in steps:
        mine = change if rank == 1 else {k: c for k, c in change.items() if k == "view"}
        prep_hits = cache.hits
        ldc.save(_layout(rank, world, v, **mine), f"{root}/s{int(v)}", plan_cache=cache)
        tmpl = {"rep": ldc.ShardedTensor.from_rank_offsets("rep", torch.zeros(8, 4)),
                "tp": ldc.ShardedTensor.from_rank_offsets("tp", torch.zeros(4, 4)),
                "flat": ldc.ShardedTensor.from_rank_offsets("flat", torch.zeros(8)),
                "obj": ldc.ShardedObject("obj", None, (world,), (rank,))}
        got = ldc.load(tmpl, f"{root}/s{int(v)}")
        want = _expected(rank, world, v, view=bool(mine.get("view")))
        out.append((cache.hits > prep_hits, all(torch.equal(got[k], want[k]) for k in ("rep", "tp", "flat")),
                    got["obj"] == want["obj"]))
    return out


def test_one_rank_changes_under_a_cached_plan_save_exactly_the_state(tmp_path):
    """Each save loads back exactly; only the layout changes of one rank (its key order) plan again."""
    for res in run_distributed(_one_rank_changes_under_cache, 2, str(tmp_path), timeout_s=60):
        assert [reused for reused, _, _ in res] == [False, True, False, True, True], res
        assert all(ok and obj for _, ok, obj in res), res
