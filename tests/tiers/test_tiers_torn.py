"""A job killed (SIGKILL) at named points of a local save or its replication never resumes from what it
left half-done: the restarted job agrees on the newest step every store of which was held completely,
and loads it bit-exactly. The victim kills itself at its point; the parent then kills the other ranks
(a whole job lost); nothing waits on a timer."""

import os
import shutil

import pytest

from dist_utils import run_distributed
from lightning_distckpt.storage.commit import KILL_AT_ENV
from lightning_distckpt.tiers import LocalTier, RecoveryPoint
from tier_helpers import check_loaded, options, run_killed, state

pytestmark = pytest.mark.tiers


def _recover(rank, world, tmp):
    tier = LocalTier(options(tmp))
    point = tier.recoverable()
    out = tier.load(state(rank, world, 0, template=True), point)
    check_loaded(out, rank, world, point.step)
    tier.wait()
    return point


# (victim rank, kill point, node directory lost with the job, step the restart resumes from)
CASES = [
    (0, "after_metadata", None, 20),  # node0's commit of step 30 torn: its stores are nowhere committed
    (0, "after_marker", None, 20),  # marker written, not yet renamed into place: still no checkpoint
    (2, "after_marker", None, 20),  # node0 committed step 30, node1 did not: ranks 2, 3 held nowhere
    (1, "tier_before_place", None, 30),  # both nodes committed: own stores suffice...
    (1, "tier_before_place", "node1", 20),  # ...but rank 3's copy on node0 was never placed
    (1, "tier_before_note", "node1", 20),  # placed, not noted: not counted as held
]


@pytest.mark.parametrize("victim,point,lost,expected", CASES)
def test_killed_local_save_is_never_used(tmp_path, victim, point, lost, expected):
    tmp = str(tmp_path)
    run_killed(4, "save30", tmp, victim, {"LDC_TIER_ARM": f"{KILL_AT_ENV}={point}"})
    if lost:
        shutil.rmtree(os.path.join(tmp, lost))
    points = run_distributed(_recover, 4, tmp)
    assert set(points) == {RecoveryPoint(expected, "local")}


def _save(rank, world, tmp):
    tier = LocalTier(options(tmp))
    for step in (10, 20, 30):
        tier.save(state(rank, world, step), step)
    tier.close()


@pytest.mark.parametrize("point", ["tier_before_place", "tier_before_note"])
def test_recovery_killed_while_fetching_then_recovers(tmp_path, point):
    """A restarted job killed while node1's lead puts the fetched copies in place: the next restart still
    recovers step 30 bit-exactly (what the killed one left is never taken as held)."""
    tmp = str(tmp_path)
    run_distributed(_save, 4, tmp)
    shutil.rmtree(os.path.join(tmp, "node1"))
    run_killed(4, "recover", tmp, 2, {"LDC_TIER_ARM": f"{KILL_AT_ENV}={point}"})
    assert not os.path.exists(os.path.join(tmp, "node1", "step_000000030"))  # never renamed into place
    assert set(run_distributed(_recover, 4, tmp)) == {RecoveryPoint(30, "local")}
