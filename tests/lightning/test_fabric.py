"""FabricDistCheckpointStrategy in a real Fabric custom loop: 2 gloo processes (TP 2) launched by
Fabric; single-process loading of the weights. Resuming the same loop under 1 process (TP 1) and
4 processes (TP 2 x DP 2) is tested by running examples/fabric_gpt_tp.py (test_lightning_examples.py)."""

import math
import sys

import pytest
import torch

from lightning_distckpt.lightning import ParallelState, load_module_weights
from lightning_helpers import SCRIPTS, StepBatches, run_script

sys.path.insert(0, SCRIPTS)
from fabric_scenarios import TPNet  # noqa: E402


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    d = tmp_path_factory.mktemp("fabric")
    results = run_script("fabric_scenarios.py", ["exact", "strictness", "--dir", str(d), "--devices", "2", "--tp", "2"],
                         str(d / "out"), world_size=2)
    return d, results


def test_fabric_exact_resume(tp2):
    _, results = tp2
    for res in results:
        assert res["loaded_step"] == 3  # plain values in the state dict are updated in place
        assert res["exact_tensors"] is True and res["exact_sched"] is True  # weights, optimizer, scheduler
        assert res["losses_c"] == {k: v for k, v in res["losses_a"].items() if int(k) >= 3}
        assert res["remainder"] == {"note": "hello", "tensor": [0, 1, 2]}  # what the state did not ask for
        assert res["rank_dirs"] == ["rank_00000", "rank_00001"]
        # fabric.load(path) without a state: every tensor whole, the TP shards put together.
        assert res["whole_shapes"] == {"fc1.weight": [16, 8], "fc1.bias": [16],  # the module's own keys
                                       "fc2.weight": [4, 16], "fc2.bias": [4]}
        assert res["whole_step"] == 3


def test_fabric_strict_and_non_strict(tp2):
    _, results = tp2
    for res in results:
        assert res["strict_missing_layer"].startswith("MissingKeysError")
        assert "model.norm.weight" in res["strict_missing_layer"]
        assert "optimizer.state.exp_avg.model.norm.weight" in res["strict_missing_layer"]
        assert res["nonstrict_step"] == 3
        assert res["nonstrict_norm_kept"] is True  # missing weights keep their values
        assert res["nonstrict_norm_opt_step"] == 0.0 and res["nonstrict_fc1_opt_step"] == 3.0
        assert res["nonstrict_trained"] == [3, 4]
        assert "not_saved" in res["strict_missing_entry"]
        assert res["nonstrict_missing_entry_kept"] == 1
        assert res["filtered_keys"] == ["fc1.bias", "fc1.weight"]


def test_single_process_weights_from_tp2_checkpoint(tp2):
    """One process, no process group: the TP2 checkpoint's weights into an un-sharded module."""
    _, results = tp2
    net = TPNet(ParallelState.single())
    load_module_weights(net, results[0]["checkpoint"], entry="model")
    assert net.fc1.weight.shape == (16, 8)
    # These are the weights after 3 steps: on step 3's batch they give the loss the 2-process run logged.
    x, y = StepBatches(3, 4, 8, 8, 4, dp_rank=0, dp_size=1).batch(3)
    with torch.no_grad():
        loss = torch.nn.functional.mse_loss(net(x), y).item()
    assert math.isclose(loss, results[0]["losses_a"]["3"], rel_tol=1e-5)
