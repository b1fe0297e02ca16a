"""Checkpoints crossing borders: a stock Lightning DDP ``.ckpt`` file and a DistCheckpointIO
directory written under stock DDP, resumed by ``DistCheckpointStrategy(tensor_parallel_size=2)``
(2 gloo processes launched by Lightning; tests/lightning_scripts/border_trainer.py)."""

import math

import pytest

from lightning_helpers import run_script


@pytest.fixture(scope="module")
def trainer_runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("borders")
    return run_script("border_trainer.py", ["stock_ddp", "plugin_ddp", "no_sharded_state_dict", "strategy_to_plugin",
                                           "fabric_checkpoint_refused", "stock_weights_only", "--dir", str(d), "--devices", "2"],
                      str(d / "out"), world_size=2, timeout=420)


def test_trainer_test_from_stock_ckpt_under_tp2(trainer_runs):
    """Trainer.test(ckpt_path="stock.ckpt") under TP 2: step 3's batch gives the stock run's step-3 loss."""
    for res in trainer_runs:
        (loss,) = res["stock_test_loss"]
        assert math.isclose(loss, res["ref_losses"]["3"], rel_tol=1e-5)


def test_stock_ckpt_resumes_under_stock_ddp_with_the_plugin(trainer_runs):
    """Border: a stock .ckpt file under stock DDP + DistCheckpointIO (read as the torch.save file it is)."""
    for res in trainer_runs:
        got = res["stock_plugin"]
        assert all(got["weights"].values()) and len(got["moments"]) == 12 and all(got["moments"].values())
        assert got["global_step"] == 3 and got["sched"] is True and got["callback_count"] == 3


@pytest.mark.parametrize("tag", ["stock", "plugin"])
def test_trainer_resumes_rank0_checkpoint_under_tp2(trainer_runs, tag):
    """Weights and Adam moments equal the stored tensors sliced for each TP rank (bit-exact); step,
    epoch, scheduler, learning rates and a stateful callback are restored; training goes on."""
    for res in trainer_runs:
        got = res[tag]
        assert got["params"] == ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
        assert all(got["weights"].values()) and len(got["weights"]) == 4, got["weights"]
        assert len(got["moments"]) == 12 and all(got["moments"].values()), got["moments"]  # exp_avg, exp_avg_sq, step
        assert got["global_step"] == 3 and got["sched"] is True and got["lr"] is True
        assert got["callback_count"] == 3  # StepCounter's state came back
        assert got["best_model_score"] is True  # a tensor in ModelCheckpoint's state, back in its place
        assert res[f"{tag}_final_step"] == 6
        # TP 2 continues where stock DDP would have gone: the same losses up to float rounding.
        for step in ("3", "4", "5"):
            assert math.isclose(res[f"{tag}_losses"][step], res["ref_losses"][step], rel_tol=1e-5)


def test_tp_module_that_describes_no_shard_is_refused_at_setup(trainer_runs):
    """Issue 16 defect 5: refused when the strategy sets up, on every rank, before any training step
    (it used to fail only at the first save, after an epoch)."""
    for res in trainer_runs:
        assert res["no_ssd"].startswith("CheckpointingError") and "define no sharded_state_dict" in res["no_ssd"]
        assert "tensor_parallel_size=2" in res["no_ssd"]
        assert res["no_ssd_steps_trained"] == 0


def test_strategy_checkpoint_resumes_under_stock_ddp_with_the_plugin(trainer_runs):
    """Border: TP 2 strategy -> stock DDP + DistCheckpointIO: whole weights and moments bit-exact
    (the optimizer state read back in torch's layout), step, scheduler, callbacks restored."""
    for res in trainer_runs:
        got = res["to_plugin"]
        assert all(got["weights"].values()) and len(got["weights"]) == 4, got["weights"]
        assert len(got["moments"]) == 12 and all(got["moments"].values()), got["moments"]
        assert got["global_step"] == 3 and got["sched"] is True and got["lr"] is True
        assert got["callback_count"] == 3 and got["best_model_score"] is True
        assert res["to_plugin_final_step"] == 6
        got = res["exported"]  # convert DIR OUT.ckpt, then stock DDP with no plugin
        assert all(got["weights"].values()) and len(got["moments"]) == 12 and all(got["moments"].values())
        assert got["global_step"] == 3 and got["sched"] is True and got["callback_count"] == 3


def test_fabric_checkpoint_refused_by_the_trainer_strategy(trainer_runs):
    for res in trainer_runs:
        msg = res["fabric_refused"]
        assert msg.startswith("CheckpointingError") and "written by fabric.save" in msg
        assert "load it with fabric.load" in msg and "load_module_weights" in msg


def test_stock_weights_only_ckpt_strict_and_non_strict(trainer_runs):
    """A weights-only stock .ckpt under TP 2: strict says it holds only the model, in Lightning's words;
    non-strict (strict: log_all) loads the weights and trains on with a fresh optimizer."""
    for res in trainer_runs:
        assert res["wo_strict"].startswith("ModelOnlyCheckpointError") and "contains only the model" in res["wo_strict"]
        assert res["wo_global_step"] == 5 and res["wo_fc1_opt_step"] == 2.0


@pytest.fixture(scope="module")
def tp2_dp2_runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("borders4")
    return run_script("border_trainer.py", ["stock_ddp", "--dir", str(d), "--devices", "4"],
                      str(d / "out"), world_size=4, timeout=600)


def test_stock_ddp_on_4_resumes_under_tp2_dp2(tp2_dp2_runs):
    """Stock DDP on 4 processes -> TP 2 x DP 2: each rank's shards bit-exact (the two DP replicas of a
    shard alike), everything else restored, the same losses."""
    for res in tp2_dp2_runs:
        got = res["stock"]
        assert all(got["weights"].values()) and len(got["moments"]) == 12 and all(got["moments"].values())
        assert got["global_step"] == 3 and got["sched"] is True and got["callback_count"] == 3
        assert got["best_model_score"] is True
        for step in ("3", "4", "5"):
            assert math.isclose(res["stock_losses"][step], res["ref_losses"][step], rel_tol=1e-5)
