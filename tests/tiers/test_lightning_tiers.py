"""Checkpoint tiers in real Trainer runs: 4 gloo processes (TP 2 x DP 2) as 2 simulated nodes of 2
ranks, local saves every 2 steps and durable ones every 6 (tests/lightning_scripts/tiers_scenarios.py).
A run ends at step 9 and a node's local tier is deleted: ``fit(ckpt_path="last")`` resumes from
local step 8 (the partner copies) and ends exactly where an uninterrupted run ends; with every local
copy gone it resumes from the durable step 6, again exactly; with nothing left it refuses on every rank.
The same under DistCheckpointModelParallelStrategy (FSDP2 x TP, DTensor state, restored after setup).
Every local copy of step 8 damaged (found as the restore reads it): resumes from local step 6, exactly."""

import pytest

from lightning_helpers import run_script

pytestmark = pytest.mark.slow

STATE = {"weights": True, "opt": True, "lr": True, "sched": True, "global_step": True, "epoch": True}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiers_trainer")
    args = ["recovery", "recovery_model_parallel", "recovery_damaged", "local_tree_fails", "--dir", str(d), "--devices", "4", "--tp", "2",
            "--ranks-per-node", "2"]
    results = run_script("tiers_scenarios.py", args, str(d / "out"), world_size=4, timeout=420)
    return d, results


def test_strategy_adds_the_tier_callback_and_first_last_starts_fresh(runs):
    _, results = runs
    for res in results:
        assert res["b_tier_callbacks"] == 1  # added by the strategy (tiers: in its config), once
        assert res["b_first_step"] == 0 and res["b_global_step"] == 9  # "last" with nothing saved: from scratch
        # each node holds the newest local step (its own shards and its partner's copy)
        assert all("step_000000008" in res["after_b"][f"local/{node}"] for node in ("node0", "node1"))
        assert res["after_b"]["checkpoints"] == ["last.ckpt", "tiers-last.json"]  # durable step 6, the marker
    # Pruning: each node's lead, once its own local save is done (other ranks may list a node whose lead is
    # still finishing), holds the keep_local=2 newest steps; the older ones went as the steps that made the
    # next saves due started (LocalTier.begin).
    for rank, node in ((0, "node0"), (2, "node1")):
        assert results[rank]["after_b"][f"local/{node}"] == ["step_000000006", "step_000000008"], results[rank]


def test_one_node_lost_resumes_from_the_newest_local_step_exactly(runs):
    _, results = runs
    for res in results:
        assert res["c_first_step"] == 8  # node 0's tier gone: node 1's partner copies of step 8
        assert res["c_exact"] == STATE  # weights, optimizer, scheduler, loops: as the uninterrupted run's
        assert res["c_losses_match"] is True
        # the resumed run saved on: both nodes hold step 10
        assert all("step_000000010" in res["after_c"][f"local/{node}"] for node in ("node0", "node1"))


def test_test_with_last_loads_the_newest_local_weights(runs):
    _, results = runs
    for res in results:
        assert len(res["test_last"]) == 1  # trainer.test(ckpt_path="last") ran from local step 10
        assert res["test_last_weights"] is True  # the uninterrupted run's final weights


def test_every_local_copy_lost_resumes_from_durable_exactly(runs):
    _, results = runs
    for res in results:
        assert res["d_first_step"] == 6
        assert res["d_exact"] == STATE


def test_nothing_recoverable_refuses_on_every_rank(runs):
    _, results = runs
    for res in results:
        assert res["nothing_left"].startswith("IncompleteCheckpointError")
        assert "no step is recoverable" in res["nothing_left"] and "tiers-last.json" in res["nothing_left"]
        assert res["marker"] is True  # the marker is the user's to remove: never deleted behind their back


def test_model_parallel_strategy_resumes_local_then_durable_exactly(runs):
    _, results = runs
    for res in results:
        assert res["mp_c"] == [8, True]  # node 0 lost: local step 8 from the partner copies, exact
        assert res["mp_d"] == [6, True]  # every local copy lost: durable step 6, exact


def test_damaged_local_copies_fall_back_to_an_older_step_exactly(runs):
    _, results = runs
    for res in results:
        assert res["damaged_first_step"] == 6  # step 8 damaged in every copy: local step 6, module and optimizer
        assert res["damaged_exact"] == STATE


def test_a_rank_failing_its_local_tree_fails_every_rank(runs):
    """The local save's tree is built without an agreement of its own: the save's handshake raises the
    failing rank's error on every rank, before anything of that step is written."""
    _, results = runs
    for res in results:
        assert "rank 1" in res["tree_fails"] and "cannot describe its shards at step 4" in res["tree_fails"]
        for node in ("local/node0", "local/node1"):
            assert res["tree_fails_listing"][node] == ["step_000000002"]
