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
