"""What a tier reuses: a point's completed local copy across the parts of one restore (the second load
of a point fetches nothing more and skips the checks when its node holds what it reads), and the tiers'
gloo group across tiers of one process (one group per set of ranks, not one per tier)."""

import os
import shutil

import pytest

from dist_utils import run_distributed
from lightning_distckpt.core.errors import ArgumentError
from lightning_distckpt.tiers import LocalTier, RecoveryPoint, recover
from lightning_distckpt.tiers.groups import cached_groups
from tier_helpers import check_loaded, full, options, state

pytestmark = pytest.mark.tiers


def _save(rank, world, tmp, steps):
    tier = LocalTier(options(tmp))
    for step in steps:
        tier.save(state(rank, world, step), step)
    tier.close()


def _count_completions():
    """Counts the calls of the fetch step (listing, checks, exchanges) of local loads in this process."""
    calls = []
    real = recover.complete_local_copy

    def counted(*a, **k):
        calls.append(a[1])
        return real(*a, **k)

    recover.complete_local_copy = counted
    return calls


def _parts(rank, world, tmp):
    calls = _count_completions()
    tier = LocalTier(options(tmp))
    point = tier.recoverable()
    rows = full(point.step)[rank * 4:(rank + 1) * 4]
    sd = state(rank, world, 0, template=True)
    counts = []
    out = tier.load({"w": sd["w"]}, point)  # the module's part: each rank's own rows
    assert out["w"].equal(rows)
    counts.append(len(calls))
    out = tier.load({"w": sd["w"]}, point)  # the same again: nothing to fetch or check
    assert out["w"].equal(rows)
    counts.append(len(calls))
    out = tier.load(state(rank, world, 0, template=True), point)  # "b" is read from rank 0's store
    check_loaded(out, rank, world, point.step)
    counts.append(len(calls))
    out = tier.load(state(rank, world, 0, template=True), point)
    check_loaded(out, rank, world, point.step)
    counts.append(len(calls))
    tier.save(state(rank, world, 40), 40)  # a save forgets what earlier loads completed
    point = tier.recoverable()
    check_loaded(tier.load(state(rank, world, 0, template=True), point), rank, world, 40)
    counts.append(len(calls))
    tier.close()
    return point, counts


def test_second_load_of_a_point_skips_the_fetch(tmp_path):
    tmp = str(tmp_path)
    run_distributed(_save, 4, tmp, [10, 30])
    shutil.rmtree(os.path.join(tmp, "node1"))
    results = run_distributed(_parts, 4, tmp)
    assert {p for p, _ in results} == {RecoveryPoint(40, "local")}
    # node1's ranks fetch their own stores, then rank 0's for "b" (needed by the third load only);
    # every rank takes the same path: the skip is agreed
    assert [c for _, c in results] == [[1, 1, 2, 2, 3]] * 4
    held = sorted(os.listdir(os.path.join(tmp, "node1", "step_000000030", "data")))
    assert held == ["rank_00000", "rank_00002", "rank_00003"]


def _count_openings():
    """Counts, in this process, the openings of local copies by loads and the reads of a checkpoint's
    common state (each an unpickling)."""
    from lightning_distckpt.reading import checkpoint, shared_source

    opened, common = [], []
    real_open, real_common = shared_source.open_checkpoint, checkpoint.OpenedCheckpoint.load_common

    def counted_open(path, *a, **k):
        opened.append(path)
        return real_open(path, *a, **k)

    def counted_common(self, *a, **k):
        common.append(self.path)
        return real_common(self, *a, **k)

    shared_source.open_checkpoint = counted_open
    checkpoint.OpenedCheckpoint.load_common = counted_common
    return opened, common


def _one_opening(rank, world, tmp):
    opened, common = _count_openings()
    tier = LocalTier(options(tmp))
    point = tier.recoverable()
    before = len(common)
    first = tier.load({"w": state(rank, world, 0, template=True)["w"]}, point)  # the module's part
    first["step"] = "the caller's own"  # never seen by the next load
    check_loaded(tier.load(state(rank, world, 0, template=True), point), rank, world, point.step)  # the rest
    counts = [(len(opened), len(common) - before)]
    tier.save(state(rank, world, 40), 40)  # a new step: a new copy, opened anew
    point = tier.recoverable()
    before = len(common)
    check_loaded(tier.load(state(rank, world, 0, template=True), point), rank, world, 40)
    counts.append((len(opened), len(common) - before))
    tier.close()
    return counts


@pytest.mark.parametrize("lost", [False, True])
def test_parts_of_a_restore_open_the_copy_once(tmp_path, lost):
    """The loads of one point share one opening of the copy and one read of its common state per rank,
    each load's result its own (node1 lost: its ranks fetch first, the same after)."""
    tmp = str(tmp_path)
    run_distributed(_save, 4, tmp, [10, 30])
    if lost:
        shutil.rmtree(os.path.join(tmp, "node1"))
    assert run_distributed(_one_opening, 4, tmp) == [[(1, 1), (2, 1)]] * 4


def _two_tiers(rank, world, tmp):
    first = LocalTier(options(tmp))
    first.save(state(rank, world, 10), 10)  # in flight when the second tier takes the group
    second = LocalTier(options(tmp))
    assert second._ctx.comm.group is first._ctx.comm.group and cached_groups() == 1
    with pytest.raises(ArgumentError, match="newer LocalTier"):
        first.save(state(rank, world, 20), 20)
    first.close()  # its save finished when the group was taken: nothing raised
    second.save(state(rank, world, 20), 20)
    point = second.recoverable()
    check_loaded(second.load(state(rank, world, 0, template=True), point), rank, world, 20)
    second.close()
    third = LocalTier(options(tmp))
    assert third._ctx.comm.group is first._ctx.comm.group and cached_groups() == 1
    third.close()
    return point


def test_tiers_of_one_process_share_one_group(tmp_path):
    assert set(run_distributed(_two_tiers, 4, str(tmp_path))) == {RecoveryPoint(20, "local")}
