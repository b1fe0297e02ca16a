"""Fabric checkpoints crossing borders (2 gloo processes launched by Fabric;
tests/lightning_scripts/border_fabric.py): a stock Fabric DDP ``torch.save`` file and a
DistCheckpointIO directory written under stock Fabric DDP, loaded by
``FabricDistCheckpointStrategy(tensor_parallel_size=2)``; a TP 2 checkpoint read whole and loaded in part."""

import math

import pytest

from lightning_helpers import run_script

PARAMS = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]


@pytest.fixture(scope="module")
def fabric_runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("borders_fabric")
    return run_script("border_fabric.py", ["stock_file", "plugin_dir", "tp2_whole", "no_sharded_state_dict",
                                           "tp2_to_plugin", "trainer_checkpoint_refused", "trainer_file", "--dir", str(d)],
                      str(d / "out"), world_size=2, timeout=420)


@pytest.mark.parametrize("tag", ["file", "plugin"])
def test_fabric_tp2_loads_stock_ddp_checkpoint(fabric_runs, tag):
    """``fabric.load`` under TP 2 of what stock Fabric DDP saved (a torch.save file; defect 2: a
    directory of the plugin): weights and Adam moments equal the stored tensors sliced for each
    rank, bit-exact; the step and the scheduler come back; training continues on the same losses."""
    for res in fabric_runs:
        got = res[tag]
        assert set(got["equal"]) == set(PARAMS) | {f"{p}.{k}" for p in PARAMS for k in ("exp_avg", "exp_avg_sq", "step")}
        assert all(got["equal"].values()), got["equal"]
        assert got["step"] == 3 and got["sched"] is True
        for step in ("3", "4", "5"):
            assert math.isclose(res[f"{tag}_losses"][step], res["ref_losses"][step], rel_tol=1e-5)


def test_fabric_tp2_checkpoint_read_whole_has_module_keys(fabric_runs):
    """Defect 1: the module's entry read whole is keyed as its state_dict (no "model." prefix), so a
    stock module loads it strictly."""
    for res in fabric_runs:
        assert res["whole_model_keys"] == sorted(PARAMS)
        assert res["whole_loads_strict"] is True


def test_fabric_load_of_model_alone_returns_complete_optimizer_state(fabric_runs):
    """Defect 3: ``fabric.load(ckpt, {"model": model})`` returns the optimizer's state with its moments."""
    for res in fabric_runs:
        entries = res["rest_optimizer_entries"]
        assert sorted(entries) == [f"model.{p}" for p in sorted(PARAMS)]
        assert all(v == ["exp_avg", "exp_avg_sq", "step"] for v in entries.values()), entries
        assert res["rest_exp_avg_shape"] == [16, 8]  # whole, not this rank's shard
        assert res["rest_step"] == 3


def test_fabric_setup_refuses_a_module_that_describes_no_shard(fabric_runs):
    """Defect 5: fabric.setup under TP 2 refuses, on every rank, a module with no sharded_state_dict."""
    for res in fabric_runs:
        assert res["no_ssd"].startswith("CheckpointingError") and "define no sharded_state_dict" in res["no_ssd"]


def test_tp2_checkpoint_loads_under_stock_fabric_ddp_with_the_plugin(fabric_runs):
    """Border: Fabric TP 2 -> stock Fabric DDP + DistCheckpointIO: the module's own keys and the
    optimizer state in torch's layout, bit-exact; step and scheduler restored."""
    for res in fabric_runs:
        got = res["to_plugin"]
        assert len(got["equal"]) == 16 and all(got["equal"].values()), got["equal"]
        assert got["step"] == 3 and got["sched"] is True


def test_trainer_checkpoint_refused_by_fabric_tp_strategy(fabric_runs):
    for res in fabric_runs:
        msg = res["trainer_refused"]  # the strategy's sharded Trainer checkpoint: not mapped into Fabric's names
        assert msg.startswith("CheckpointingError") and "written by a Trainer" in msg
        assert "trainer.fit" in msg and "load_module_weights" in msg


def test_stock_fabric_file_loads_under_stock_fabric_ddp_with_the_plugin(fabric_runs):
    for res in fabric_runs:
        got = res["file_plugin"]
        assert len(got["equal"]) == 16 and all(got["equal"].values()) and got["step"] == 3


def test_trainer_ckpt_file_into_fabric_state_under_tp2(fabric_runs):
    """A Trainer's .ckpt layout read by fabric.load into {"model", "optimizer"} under TP 2: weights and
    moments bit-exact per shard; the rest (schedulers, loops, step) returned as saved."""
    for res in fabric_runs:
        got = res["trainer_file"]
        assert len(got["equal"]) == 16 and all(got["equal"].values()), got["equal"]
        assert {"lr_schedulers", "loops", "global_step", "epoch"} <= set(got["rest"]) and got["sched"] is True
