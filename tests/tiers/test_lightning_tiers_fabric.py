"""Checkpoint tiers in a real Fabric loop (FabricTiers): 4 gloo processes (TP 2 x DP 2) as 2 simulated
nodes, local saves every 2 steps, a durable fabric.save at step 6, a run ending at step 9
(tests/lightning_scripts/fabric_tiers_scenarios.py). With node 0's local tier deleted, a restart
restores local step 8 from node 1's partner copies; with every local copy deleted, the durable step
6; both train on to step 10 and end exactly where an uninterrupted loop ends. The same under
FabricDistCheckpointModelParallelStrategy (FSDP2 x TP 2, DTensor state)."""

import pytest

from lightning_helpers import run_script

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiers_fabric")
    return run_script("fabric_tiers_scenarios.py", ["recovery", "--dir", str(d), "--devices", "4", "--tp", "2",
                                                    "--ranks-per-node", "2"], str(d / "out"), world_size=4, timeout=420)


def test_fabric_restores_the_newest_recoverable_step_exactly(results):
    for res in results:
        assert res["b_restored"] is True  # a first run: nothing to restore, the state untouched
        assert res["one_node_lost"] == {"point": [8, "local"], "step": 8, "exact": True, "losses_match": True}
        assert res["all_local_lost"] == {"point": [6, "durable"], "step": 6, "exact": True, "losses_match": True}


def test_fabric_model_parallel_restores_the_newest_recoverable_step_exactly(tmp_path):
    results = run_script("fabric_tiers_scenarios.py", ["model_parallel", "--dir", str(tmp_path), "--devices", "4",
                                                       "--tp", "2", "--ranks-per-node", "2"], str(tmp_path / "out"),
                         world_size=4, timeout=420)
    for res in results:
        assert res["b_restored"] is True
        assert res["one_node_lost"] == {"point": [8, "local"], "step": 8, "exact": True}
        assert res["all_local_lost"] == {"point": [6, "durable"], "step": 6, "exact": True}
