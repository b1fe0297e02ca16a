"""Cells of the border matrix (docs/lightning.md section 7) that no other test covers, on 2 gloo
processes: ONE launch of tests/lightning_scripts/matrix_scenarios.py (Lightning / Fabric start the second
rank) in which each writer saves once, at its 2-process split, and every loader of its row is tried
against it. Cells that load are compared bit for bit with the tensors the writer held (weights and every
Adam state); cells that refuse must name the writer and what to do, on both ranks."""

import pytest

from lightning_helpers import run_script

PARAMS = ["fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight"]
STATE = {f"{p}.{k}" for p in PARAMS for k in ("exp_avg", "exp_avg_sq", "step")} | set(PARAMS)


@pytest.fixture(scope="module")
def cells(tmp_path_factory):
    d = tmp_path_factory.mktemp("borders_matrix")
    return run_script("matrix_scenarios.py", ["fabric_rows", "trainer_rows", "--dir", str(d)], str(d / "out"),
                      world_size=2, timeout=420)


def _on_both(cells, key):
    values = [res[key] for res in cells]
    assert len(cells) == 2 and values[0] == values[1], values  # the same outcome on every rank
    return values[0]


# -- cells that load: bit-exact against the writer's tensors ------------------------------------------
@pytest.mark.parametrize("cell, names", [
    ("fpl_f_plugin", STATE),   # F+plugin -> F+plugin (stock Fabric DDP + the plugin)
    ("fpl_convert", STATE),    # F+plugin -> convert: Fabric's dict, optimizer in torch's layout
    ("fpl_inference", PARAMS),  # F+plugin -> load_module_weights(m, dir, entry="model")
    ("sf_inference", PARAMS),  # stock Fabric file -> load_module_weights(m, file, entry="model")
    ("fmp_f_plugin", STATE),   # Fabric ModelParallel (DP 2) -> F+plugin: module keys, torch's optimizer layout
    ("fmp_f_mp", STATE),       # Fabric ModelParallel (DP 2) -> itself (DP 2)
    ("fmp_convert", STATE),    # Fabric ModelParallel -> convert
    ("fmp_inference", PARAMS),  # Fabric ModelParallel -> load_module_weights
    ("fdcp_f_mp", STATE),      # Fabric's own ModelParallelStrategy (DCP + meta.pt) -> F+MP, read as Fabric reads it
    ("tpl_f_tp", STATE),       # T+plugin (DP 2) -> F+TP (TP 2): into {"model", "optimizer"}
    ("tpl_convert", STATE),    # T+plugin -> convert: Lightning's dict, optimizer in torch's layout
    ("stock_inference", PARAMS),  # stock Trainer DDP .ckpt -> load_module_weights(m, file)
    ("tpl_inference", PARAMS),  # T+plugin -> load_module_weights(m, dir)
    ("ttp_inference", PARAMS),  # T+TP (TP 2) -> load_module_weights(m, dir): whole weights
    ("ftp_convert", STATE),    # F+TP (TP 2) -> convert: the module's own keys, whole tensors
    ("ftp_inference", PARAMS),  # F+TP -> load_module_weights(m, dir, entry="model")
])
def test_cell_loads_bit_exact(cells, cell, names):
    assert _on_both(cells, cell) == "ok"
    for res in cells:
        got = res[f"{cell}_equal"]
        assert set(got) == set(names) and all(got.values()), got


# -- cells that refuse: the writer named, and what to do ----------------------------------------------
FABRIC_TO_TRAINER = {"sf": "by fabric.save or another tool", "fpl": "by fabric.save with DistCheckpointIO",
                     "ftp": "by fabric.save under FabricDistCheckpointStrategy",
                     "fmp": "by fabric.save under FabricDistCheckpointModelParallelStrategy"}


@pytest.mark.parametrize("row", sorted(FABRIC_TO_TRAINER))
def test_fabric_checkpoint_refused_by_trainer_plugin(cells, row):
    """Rows written by fabric.save, column T+plugin (issue 16): not Lightning's raw
    ``KeyError: 'pytorch-lightning_version'`` but a refusal naming the writer and what to do."""
    msg = _on_both(cells, f"{row}_t_plugin")
    assert msg.startswith("NotATrainerCheckpointError") and f"written {FABRIC_TO_TRAINER[row]}" in msg, msg
    assert "not by a Trainer" in msg and "fabric.load" in msg and "load_module_weights" in msg


@pytest.mark.parametrize("row", sorted(FABRIC_TO_TRAINER))
@pytest.mark.parametrize("col", ["t_tp", "t_mp"])
def test_fabric_checkpoint_refused_by_trainer_strategies(cells, row, col):
    """Rows written by fabric.save, columns T+TP (TP 2) and T+MP (DP 1 x TP 2)."""
    msg = _on_both(cells, f"{row}_{col}")
    assert msg.startswith("CheckpointingError") and "written by fabric.save" in msg, msg
    assert ("load_module_weights" in msg) if col == "t_tp" else ("not by DistCheckpointModelParallelStrategy" in msg)


@pytest.mark.parametrize("row", ["stock", "tpl", "ttp", "tmp"])
def test_trainer_checkpoint_into_fabric_plugin_is_fabrics_own_error(cells, row):
    """Rows written by a Trainer, column F+plugin: Fabric's own KeyError naming the entry ("model")
    a Trainer's dict does not have."""
    msg = _on_both(cells, f"{row}_f_plugin")
    assert msg.startswith("KeyError") and "'model' that does not exist" in msg, msg


@pytest.mark.parametrize("row", ["ttp", "tmp"])
def test_trainer_strategy_checkpoint_refused_by_fabric_tp(cells, row):
    """Rows T+TP (TP 2) and T+MP (DP 2), column F+TP (TP 2): written by a Trainer, naming trainer.fit
    and load_module_weights."""
    msg = _on_both(cells, f"{row}_f_tp")
    assert msg.startswith("CheckpointingError") and "written by a Trainer" in msg
    assert "trainer.fit" in msg and "load_module_weights" in msg


def test_tp_strategy_checkpoint_refused_by_trainer_mp(cells):
    """Row T+TP (TP 2), column T+MP: names DistCheckpointStrategy as the writer."""
    msg = _on_both(cells, "ttp_t_mp")
    assert msg.startswith("CheckpointingError") and "written by DistCheckpointStrategy" in msg
    assert "not by DistCheckpointModelParallelStrategy" in msg and "key_map" in msg


def test_fabric_mp_checkpoint_refused_by_fabric_tp(cells):
    msg = _on_both(cells, "fmp_f_tp")
    assert msg.startswith("CheckpointingError"), msg
    assert "written by FabricDistCheckpointModelParallelStrategy" in msg and "load_module_weights" in msg


@pytest.mark.parametrize("row, writer", [
    ("stock", "by a Trainer under a stock strategy (one torch.save .ckpt file)"),
    ("tpl", "by DistCheckpointIO under a rank-0 strategy"),
    ("ttp", "by DistCheckpointStrategy"),
    ("tmp", "by a Trainer under DistCheckpointModelParallelStrategy"),
    ("sf", "by fabric.save or another tool"),
    ("fpl", "by fabric.save with DistCheckpointIO"),
    ("ftp", "by fabric.save under FabricDistCheckpointStrategy"),
])
def test_other_checkpoints_refused_by_fabric_mp(cells, row, writer):
    """Every other row into the Fabric ModelParallel subclass (DP 2): it loads only its own checkpoints."""
    msg = _on_both(cells, f"{row}_f_mp")
    assert msg.startswith("CheckpointingError") and f"written {writer}" in msg, msg
    assert "not by FabricDistCheckpointModelParallelStrategy" in msg and "key_map" in msg


DCP = "written by torch.distributed.checkpoint (DCP: Lightning's own ModelParallelStrategy"


def test_lightning_dcp_directory_resumes_under_trainer_mp(cells):
    """Row Lightning's own ModelParallelStrategy (DP 2, a DCP directory), column T+MP (DP 1 x TP 2): read
    as the stock strategy reads it, resharded: every weight and Adam state bit-exact against the writer's,
    step and scheduler restored, training goes on; the next save is in our format."""
    assert _on_both(cells, "dcp_t_mp") == "ok"
    for res in cells:
        got = res["dcp_t_mp_resumed"]
        assert set(got["equal"]) == STATE and all(got["equal"].values()), got["equal"]
        assert got["step"] == 2 and got["sched"] is True and got["final_step"] == 4 and got["resaved_step"] == 4


def test_fabric_dcp_directory_refused_by_trainer_mp(cells):
    """Fabric's own ModelParallelStrategy also writes DCP + meta.pt, but no Trainer entries: refused,
    not read as a Trainer's DCP checkpoint."""
    msg = _on_both(cells, "fdcp_t_mp")
    assert msg.startswith("CheckpointingError") and "written by fabric.save or another tool" in msg, msg


@pytest.mark.parametrize("col", ["t_plugin", "t_tp", "f_plugin", "f_mp", "convert"])
def test_lightning_dcp_directory_refused_naming_dcp(cells, col):
    """Row Lightning's own ModelParallelStrategy (DP 2, a DCP directory): every reader of ours names
    DCP as the writer and points at ``lightning_distckpt.load(template, path, key_map=...)``."""
    msg = _on_both(cells, f"dcp_{col}")
    assert DCP in msg and "key_map" in msg, msg


def test_lightning_dcp_directory_refused_by_fabric_tp(cells):
    msg = _on_both(cells, "dcp_f_tp")
    assert msg.startswith("CheckpointingError") and "written by a Trainer, by torch.distributed.checkpoint" in msg
    assert "load_module_weights" in msg and "optimizer_0.param_groups" not in msg  # top-level entries only
