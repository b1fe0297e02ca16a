"""``FabricDistCheckpointModelParallelStrategy``: Fabric's ModelParallelStrategy (FSDP2 / tensor
parallel, CPU gloo) with fabric.save / fabric.load in our format. Real Fabric runs launched by Fabric
(tests/lightning_scripts/fabric_model_parallel_scenarios.py)."""

import pytest

from lightning_helpers import run_script


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("fabric_model_parallel")


@pytest.fixture(scope="module")
def dp2(ckpt_dir):
    return run_script("fabric_model_parallel_scenarios.py", ["exact", "--dir", str(ckpt_dir), "--devices", "2"],
                      str(ckpt_dir / "dp2"), world_size=2, timeout=300)


def test_fabric_resume_is_bit_exact(dp2):
    """DP 2: saved at step 3, loaded into a fresh module and optimizer: every tensor equals the stored
    one read whole, ``state["step"]`` comes back, and 3 more steps end bit-exact as the uninterrupted run."""
    for res in dp2:
        assert len(res["restored"]) == 16 and all(res["restored"].values()), res["restored"]
        assert res["step"] == 3 and res["rest"] == []
        assert len(res["final"]) == 16 and all(res["final"].values()), res["final"]


def test_entries_not_asked_for_come_back_whole(dp2):
    for res in dp2:
        assert res["unasked_optimizer"] == ["exp_avg"] * 4 + ["exp_avg_sq"] * 4 + ["step"] * 4


def test_a_missing_checkpoint_fails_on_every_rank(dp2):
    for res in dp2:
        assert res["missing"].startswith("CheckpointNotFoundError") and "no such directory" in res["missing"]


def test_dp2_checkpoint_loads_under_tp2(dp2, ckpt_dir):
    for res in run_script("fabric_model_parallel_scenarios.py", ["other_split", "--tp", "2", "--dir", str(ckpt_dir),
                                                                 "--devices", "2"], str(ckpt_dir / "tp2"), world_size=2,
                          timeout=300):
        assert len(res["restored"]) == 16 and all(res["restored"].values()), res["restored"]
        assert res["step"] == 3
