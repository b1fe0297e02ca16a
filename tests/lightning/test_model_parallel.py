"""``DistCheckpointModelParallelStrategy``: Lightning's ModelParallelStrategy (FSDP2 / tensor parallel
through DTensor, on CPU gloo meshes) saving our format. Real Trainer runs launched by Lightning
(tests/lightning_scripts/model_parallel_scenarios.py)."""

import math

import pytest
import torch
from lightning.pytorch.plugins import TorchCheckpointIO
from lightning.pytorch.strategies import StrategyRegistry

from lightning_distckpt.core.errors import ArgumentTypeError
from lightning_distckpt.lightning import DistCheckpointIO, DistCheckpointModelParallelStrategy, load_module_weights
from lightning_helpers import run_script


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("model_parallel")


@pytest.fixture(scope="module")
def dp2_runs(ckpt_dir):
    """DP 2: reference, interrupted + resumed (sync and async); then the step-3 checkpoint under DP 1 x TP 2."""
    return run_script("model_parallel_scenarios.py", ["train_dp2", "resume_split", "to_stock_ddp", "from_stock_ddp",
                                                      "to_tp_strategy", "refuse_plugin_dir", "save_barrier", "--tp", "2",
                                                      "--dir", str(ckpt_dir), "--devices", "2"],
                      str(ckpt_dir / "dp2"), world_size=2, timeout=420)


def _all_restored(got):
    assert len(got["state"]) == 16 and all(got["state"].values()), got["state"]  # 4 params x (w, step, moments)
    assert got["global_step"] == 3 and got["sched"] and got["lr"] and got["callback_count"] == 3


@pytest.mark.parametrize("mode", ["sync", "async", "async_bg"])
def test_interrupted_and_resumed_run_equals_uninterrupted(dp2_runs, mode):
    """ModelCheckpoint(save_last=True) every 3 steps, then ckpt_path="last": weights, AdamW moments and
    step, scheduler, loops and a stateful callback restored; the run ends bit-exact as the reference."""
    for res in dp2_runs:
        _all_restored(res[f"{mode}_restored"])
        assert res[f"{mode}_losses"] == {k: v for k, v in res["ref_losses"].items() if int(k) >= 3}
        assert len(res[f"{mode}_final"]) == 16 and all(res[f"{mode}_final"].values()), res[f"{mode}_final"]
        assert res[f"{mode}_files"] == ["last.ckpt", "step=3.ckpt", "step=6.ckpt"]


def _continues(res, ref):
    _all_restored(res["restored"])
    assert res["final_step"] == 6
    (test_loss,) = res["test_losses"]  # Trainer.test(ckpt_path=step 3) on step 3's batch
    assert math.isclose(test_loss, ref["3"], rel_tol=1e-5)
    for step in ("3", "4", "5"):  # another split: the same losses up to float rounding
        assert math.isclose(res["losses"][step], ref[step], rel_tol=1e-5)


def test_dp2_checkpoint_resumes_under_tp2(dp2_runs):
    for res in dp2_runs:
        _continues(res, res["ref_losses"])


def test_dp2_checkpoint_resumes_in_one_process(dp2_runs, ckpt_dir):
    (res,) = run_script("model_parallel_scenarios.py", ["resume_split", "--dir", str(ckpt_dir), "--devices", "1"],
                        str(ckpt_dir / "one"), world_size=1, timeout=300)
    _continues(res, dp2_runs[0]["ref_losses"])


@pytest.mark.slow
def test_dp2_checkpoint_resumes_under_dp2_tp2(dp2_runs, ckpt_dir):
    """4 processes, FSDP2 over tensor parallel (strided shards): each rank reads its slices."""
    for res in run_script("model_parallel_scenarios.py", ["resume_split", "--tp", "2", "--dir", str(ckpt_dir),
                                                          "--devices", "4"], str(ckpt_dir / "four"), world_size=4,
                          timeout=420):
        _continues(res, dp2_runs[0]["ref_losses"])


@pytest.mark.parametrize("tag", ["plugin", "exported"])
def test_stock_ddp_resumes_the_checkpoint(dp2_runs, tag):
    """Borders: stock DDP + DistCheckpointIO reads it whole (optimizer state in torch's layout);
    ``export_torch_file`` (``convert``) gives one file stock DDP resumes with no plugin."""
    for res in dp2_runs:
        _all_restored(res[f"{tag}_restored"])
        for step in ("3", "4", "5"):
            assert math.isclose(res[f"{tag}_losses"][step], res["ref_losses"][step], rel_tol=1e-5)


def test_weights_into_a_plain_module_in_one_process(dp2_runs, ckpt_dir):
    """Inference border: ``load_module_weights`` / ``load_lightning_module``'s reader, one process."""
    module = torch.nn.Module()
    module.fc1, module.fc2 = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)
    path = str(ckpt_dir / "sync" / "step=3.ckpt")
    load_module_weights(module, path)
    stored = DistCheckpointIO().load_checkpoint(path)["state_dict"]
    assert set(stored) == set(module.state_dict())
    assert all(torch.equal(v, stored[k]) for k, v in module.state_dict().items())


@pytest.mark.parametrize("tag", ["stock_file", "plugin_dir"])
def test_stock_ddp_checkpoints_resume_under_tp2(dp2_runs, tag):
    """Borders: a stock DDP .ckpt file and a DistCheckpointIO directory (tensors by path, optimizer
    state by index) resumed by the subclass at DP 1 x TP 2: every tensor bit-exact, training goes on."""
    for res in dp2_runs:
        _all_restored(res[f"{tag}_restored"])
        for step in ("3", "4", "5"):
            assert math.isclose(res[f"{tag}_losses"][step], res["ref_losses"][step], rel_tol=1e-5)


def test_distcheckpointstrategy_resumes_it_under_tp2(dp2_runs):
    """Border: DistCheckpointStrategy (TP 2, its own TP layers) reads the subclass's checkpoint
    (names by path, optimizer state by parameter name): each rank's shards bit-exact."""
    for res in dp2_runs:
        _all_restored(res["tp_restored"])
        for step in ("3", "4", "5"):
            assert math.isclose(res["tp_losses"][step], res["ref_losses"][step], rel_tol=1e-5)


def test_fabric_checkpoint_refused_naming_its_writer(dp2_runs):
    for res in dp2_runs:
        msg = res["refused"]
        assert msg.startswith("CheckpointingError") and "by fabric.save with DistCheckpointIO" in msg
        assert "resume it with the strategy that wrote it" in msg
        assert "fabric.pt was written by fabric.save or another tool" in res["refused_file"]


def test_registered_and_refuses_a_foreign_checkpoint_io():
    assert StrategyRegistry["model_parallel_distckpt"]["strategy"] is DistCheckpointModelParallelStrategy
    strategy = DistCheckpointModelParallelStrategy(checkpoint={"async_save": True})
    assert isinstance(strategy.checkpoint_io, DistCheckpointIO) and strategy.checkpoint_io.config.async_save
    strategy.checkpoint_io = TorchCheckpointIO()
    with pytest.raises(ArgumentTypeError, match="needs a DistCheckpointIO"):
        strategy.checkpoint_io


def test_no_barrier_after_a_save_and_a_failing_tree_fails_every_rank(dp2_runs):
    """As DistCheckpointStrategy: Trainer.save_checkpoint's barrier after a save (sync or async) is left
    out, the save's own agreements having met every rank; a rank that cannot build its tree fails the
    save's handshake, so every rank raises its error (rank 1 named) and nothing is written."""
    for res in dp2_runs:
        assert res["barrier_sync"] == {"barriers": 0, "committed_on_return": True, "pending": False,
                                       "barriers_after": 1}
        assert res["barrier_async"] == {"barriers": 0, "committed_on_return": False, "pending": True,
                                        "barriers_after": 1}
        assert res["barrier_sync_committed_after_fit"] and res["barrier_async_committed_after_fit"]
        assert "rank 1" in res["tree_fails"] and "contains itself" in res["tree_fails"], res["tree_fails"]
        assert res["tree_fails_written"] == []
