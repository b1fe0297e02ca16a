"""DistCheckpointStrategy in real Trainer runs: 2 gloo processes (TP 2) launched by Lightning, then a
resume under 1 process (TP 1). The 4-process (TP 2 x DP 2) resume is in test_lightning_examples.py."""

import math
import os

import pytest

import torch

from lightning_distckpt.lightning import load_lightning_module
from lightning_helpers import TEST_STEP, TPMLP, run_script

SCENARIOS = ["tp_layers", "exact_resume", "failures", "nonstrict", "topk_last", "link_last", "exact_resume_yaml",
             "save_barrier", "replaced_state_dict"]


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    """One launch of 2 processes running every scenario in turn (Lightning startup is the slow part)."""
    d = tmp_path_factory.mktemp("strategy")
    results = run_script("trainer_scenarios.py", [*SCENARIOS, "--dir", str(d), "--devices", "2", "--tp", "2"],
                         str(d / "out"), world_size=2, timeout=420)
    return d, results


def test_tensor_parallel_layers_and_groups(tp2):
    """TP x DP groups of the world, and TP 2 layers: same outputs and gradients as the un-sharded layers
    (TP shards' gradients are their slices, replicated ones whole: nothing averaged across TP)."""
    _, results = tp2
    for rank, res in enumerate(results):
        groups, dp_only, bad, checks, described = res["tp_layers"]
        assert groups == [2, rank, 1, 0]
        assert dp_only == [1, 2, rank]
        assert "must be >= 1 and divide the world size 2" in bad
        assert all(checks.values()), checks
        assert described["m.fc1.weight"] == [[8, 6], [4 * rank, 0], 0, True]  # the parameter itself is the data
        assert described["m.fc2.weight"] == [[3, 8], [0, 4 * rank], 0, True]
        assert described["m.fc2.bias"] == [[3], [0], [rank, 0], True]  # replicated: rank 0 writes it
        assert described["m.norm.weight"] == [[3], [0], [rank, 0], True]


def test_a_hooks_state_dict_under_tensor_parallelism_warns_and_saves_the_modules_shards(tp2):
    """A callback's replacement of checkpoint["state_dict"] (EMA, pruning) holds this rank's TP pieces,
    which have no place in the global tensor: the module's own shards are saved (a resume restores the
    trained weights, not the hook's values) and the WARNING says why."""
    _, results = tp2
    for res in results:
        assert res["replaced_module_restored"] is True
        assert len(res["replaced_warnings"]) == 1, res["replaced_warnings"]
        assert "under tensor parallelism" in res["replaced_warnings"][0]


def test_no_second_barrier_after_a_save(tp2):
    """A synchronous save ends with every rank agreeing on its commit, a background save begins with
    every rank agreeing on its plan, so Trainer.save_checkpoint's barrier after either is left out
    (issue 29: a collective round less); a barrier called later still is one."""
    _, results = tp2
    for res in results:
        assert {k: v for k, v in res["barrier_sync"].items() if k != "torch_saves"} == {
            "barriers": 0, "committed_on_return": True, "pending": False, "barriers_after": 1}
        assert res["barrier_async"]["pending"] is True and res["barrier_async"]["barriers"] == 0
        assert res["barrier_async"]["barriers_after"] == 1
        assert res["barrier_sync_committed_after_fit"] and res["barrier_async_committed_after_fit"]


def test_only_rank_0_calls_torch_save_once_per_checkpoint(tp2):
    """As Lightning's own test_model_checkpoint_no_extraneous_invocations counts: rank 0 serializes the
    common state it writes (one torch.save per checkpoint), the other ranks only digest theirs for
    the consistency check (planning/common_check.py), in a synchronous and a background save alike."""
    _, results = tp2
    for rank, res in enumerate(results):
        for name in ("barrier_sync", "barrier_async"):
            assert res[name]["torch_saves"] == (1 if rank == 0 else 0), (rank, name)


def test_exact_resume_restores_everything(tp2):
    _, results = tp2
    for res in results:  # every rank: weights, optimizer state, LR scheduler, loops, epoch, step
        assert res["exact"] == {k: True for k in ("weights", "opt", "lr", "sched", "global_step", "epoch")}
        assert res["resumed_global_step"] == 6
        # The resumed run computes exactly the losses the uninterrupted run computed.
        assert res["losses_c"] == {k: v for k, v in res["losses_a"].items() if int(k) >= 3}
        assert res["callback_count"] == 6  # a stateful callback's state: 3 before the checkpoint + 3 after
        # hparams holding an omegaconf container round-trip through the common state, type kept.
        assert res["hparams_conf"] == ["DictConfig", {"optim": {"name": "adamw", "betas": [0.9, 0.99]}}]
        assert res["hparams_conf_is_dictconfig"] is True
        # Trainer.test(ckpt_path=...) loads the step-3 weights: step 3's batch gives step 3's training loss.
        assert len(res["test_loss"]) == 1 and math.isclose(res["test_loss"][0], res["losses_a"]["3"], rel_tol=1e-6)
    # Both TP ranks wrote their own shards; the checkpoint is committed.
    assert results[0]["rank_dirs"] == ["rank_00000", "rank_00001"]
    assert {"COMMITTED", "metadata.json", "common.pt", "data"} <= set(results[0]["ckpt_entries"])


def test_save_failing_on_one_rank_raises_on_every_rank(tp2):
    d, results = tp2
    for res in results:
        fails = res["failures"]
        # A write that fails on rank 1 only: every rank raises SaveFailedError naming rank 1.
        assert fails["write_fails_on_rank1"].startswith("SaveFailedError")
        assert "rank 1" in fails["write_fails_on_rank1"] and "meta" in fails["write_fails_on_rank1"]
        # Rank 1 cannot even describe its state: every rank raises before writing (agreed by the save's handshake).
        assert fails["describe_fails_on_rank1"].startswith("CheckpointingError")
        assert "before writing: rank 1: this rank cannot describe its state" in fails["describe_fails_on_rank1"]
        assert res["failures_global_step"] == 4  # and training went on on every rank
        assert res["good_ckpt_intact"] is True  # the earlier checkpoint at the same path survived
        assert res["leftovers"] == [], res["leftover_trees"]  # failed saves left no staging directories
        assert "state_dict/fc1.bias" in res["plain_refused"]  # read by path; what it lacks is named


def test_missing_optimizer_state_strict_and_non_strict(tp2):
    _, results = tp2
    for res in results:
        # Strict (default): the missing weights are named, on every rank (before setup, as stock's
        # load_state_dict names them: the optimizer state is read after setup, never reached here).
        assert res["strict"].startswith("MissingKeysError")
        assert "norm.weight" in res["strict"]
        # Non-strict (strict: log_all): what exists is loaded, what is missing keeps its fresh value.
        assert res["nonstrict_global_step"] == 5
        assert res["nonstrict_fc1_step"] == 5.0  # Adam step restored (3) + 2 new steps
        assert res["nonstrict_norm_step"] == 2.0  # the new layer's optimizer state started fresh
        assert res["nonstrict_norm_weight_fresh_then_trained"] is True
        assert res["module_nonstrict_global_step"] == 5  # LightningModule.strict_loading = False
        # A weights-only checkpoint (no optimizer / scheduler state): strict says so in Lightning's words...
        assert res["wo_strict"].startswith("ModelOnlyCheckpointError")
        assert "checkpoint contains only the model" in res["wo_strict"]
        # ...non-strict loads the weights and loops, starts the optimizer afresh.
        assert res["wo_first_step"] == 3 and res["wo_global_step"] == 5
        assert res["wo_fc1_opt_step"] == 2.0
        assert math.isclose(*res["wo_first_loss"], rel_tol=1e-6)


def test_model_checkpoint_top_k_and_last(tp2):
    _, results = tp2
    for res in results:
        assert res["topk_listing"] == ["last.ckpt", "step=5.ckpt", "step=6.ckpt"]  # older top-k dirs removed
        assert res["topk_best"] == ["step=5.ckpt", "step=6.ckpt"]
        assert res["topk_all_committed"] is True
        # A newer, uncommitted directory left by a crashed save is not chosen by ckpt_path="last".
        assert res["last_resumed_from"] == "last.ckpt"
        assert res["last_first_step"] == 6 and res["last_global_step"] == 8


def test_model_checkpoint_save_last_link(tp2):
    _, results = tp2
    for res in results:
        assert res["link_is_symlink"] is True and res["link_target"] == "step=4.ckpt"
        assert res["link_listing"] == ["last.ckpt", "step=4.ckpt"]
        assert res["link_first_step"] == 4  # resumed through the link
        assert res["link_listing_after"] == ["last.ckpt", "step=6.ckpt"] and res["link_target_after"] == "step=6.ckpt"


def test_yaml_configured_strategy_async_two_stage_zarr(tp2):
    _, results = tp2
    for res in results:
        assert res["yaml_exact"] == {k: True for k in ("weights", "opt", "lr", "sched", "global_step", "epoch")}
        assert res["yaml_layout"] == "zarr"
        assert res["yaml_async_commits"] == 2  # the step-3 and step-6 saves were background saves
    assert results[0]["yaml_two_stage_loads"] >= 1


def test_load_lightning_module_single_process(tp2):
    """load_from_checkpoint-style: the TP2 checkpoint into one un-sharded module, in this process."""
    _, results = tp2
    model = load_lightning_module(TPMLP, results[0]["checkpoint"])
    assert model.hparams.total_steps == 6 and not model.training  # hparams from the checkpoint, eval mode
    assert model.fc1.weight.shape == (16, 8) and model.ps.tp_size == 1
    x, y = model.test_dataloader().batch(TEST_STEP)
    with torch.no_grad():
        loss = torch.nn.functional.mse_loss(model(x), y).item()
    assert math.isclose(loss, results[0]["losses_a"][str(TEST_STEP)], rel_tol=1e-6)


@pytest.mark.parametrize("devices,tp", [(1, 1)])
def test_resume_under_another_world_size(tp2, devices, tp):
    """The TP2 checkpoint resumes under TP1 (1 process): the TP shards are put together and training
    continues from the same loss. (4 processes, TP2 x DP2, where the DP replicas are also deduplicated:
    examples/train_gpt_tp.py, run by test_lightning_examples.py, which checks the same; the scenario
    here runs with `--devices 4 --tp 2` too.)"""
    d, results = tp2
    ckpt = results[0]["checkpoint"]
    out = d / f"world{devices}"
    res = run_script("trainer_scenarios.py", ["resume_other_world", "--dir", str(out), "--devices", str(devices),
                                              "--tp", str(tp), "--resume", ckpt], str(out), world_size=devices)
    baseline = results[0]["losses_a"]
    for r in res:
        assert r["global_step"] == 6
        assert sorted(r["losses"], key=int) == ["3", "4", "5"]
        for step, loss in r["losses"].items():
            assert math.isclose(loss, baseline[step], rel_tol=1e-5), (step, loss, baseline[step])
    assert res[0]["parallel"] == f"rank 0/{devices}: tp 0/{tp}, dp 0/{devices // tp}"
    assert all(r["weights_sum"] == res[0]["weights_sum"] for r in res)  # every rank sees the same model
    assert os.path.isdir(ckpt)
