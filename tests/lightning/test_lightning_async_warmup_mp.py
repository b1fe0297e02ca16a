"""An async-saving fit under DistCheckpointModelParallelStrategy (2 real processes, FSDP2 or tensor
parallel on CPU gloo meshes) prepares its saver before the first save: the commit group at train
start, the staging pool once the optimizer holds state; both saves stage into that very pool and
the checkpoints are exact. A synchronous fit makes no saver. Scenarios:
tests/lightning_scripts/async_warmup_scenarios.py."""

import pytest

from lightning_helpers import run_script


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("async_warmup_mp")
    return run_script("async_warmup_scenarios.py", ["async_dp2", "async_tp2", "sync_dp2", "--dir", str(d),
                                                    "--devices", "2"], str(d / "out"), world_size=2, timeout=300)


@pytest.mark.parametrize("tag", ["async_dp2", "async_tp2"])
def test_first_async_save_uses_the_pool_reserved_ahead(runs, tag):
    for res in runs:
        got = res[tag]
        assert got["saver"] and got["commit_group"] and not got["pending"]  # prepared, before any save
        assert got["pool_bytes"] > 0 and got["same_pool"]  # both saves staged into the reserved pool
        assert got["peak"] == got["pool_bytes"]  # never reallocated
        assert got["files"] == ["step=3.ckpt", "step=6.ckpt"]
        assert got["exact"] and all(got["exact"].values()), got["exact"]


def test_a_sync_fit_reserves_nothing(runs):
    for res in runs:
        got = res["sync_dp2"]
        assert not got["saver"] and got["pool_bytes"] == 0
        assert got["exact"] and all(got["exact"].values()), got["exact"]
