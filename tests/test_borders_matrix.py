"""Cells of the border matrix (docs/lightning.md section 7) whose behaviour needs no second rank,
checked in this one process with real Trainer / Fabric runs on CPU (devices=1) and real files:
what a Trainer wrote (stock ``.ckpt`` or a DistCheckpointIO directory) loaded by Fabric + the plugin,
and what Fabric + the plugin wrote loaded by a Trainer + the plugin."""

import os

import pytest
import torch
from lightning.fabric import Fabric
from lightning.pytorch import LightningModule, Trainer
from torch.utils.data import DataLoader, TensorDataset

from lightning_distckpt.lightning import DistCheckpointIO


class Small(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 2)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.fc(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.01)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        return DataLoader(TensorDataset(torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)), batch_size=4)


def _trainer(root, plugins=None, max_steps=2) -> Trainer:
    return Trainer(accelerator="cpu", devices=1, max_steps=max_steps, default_root_dir=str(root), plugins=plugins,
                   logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)


def _fabric(plugin: bool) -> Fabric:
    return Fabric(accelerator="cpu", devices=1, plugins=[DistCheckpointIO()] if plugin else None)


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """Checkpoints written once: a stock Trainer .ckpt, a Trainer + plugin directory, a Fabric + plugin directory."""
    d = tmp_path_factory.mktemp("borders_matrix")
    torch.manual_seed(0)
    t = _trainer(d / "stock")
    t.fit(Small())
    t.save_checkpoint(str(d / "stock.ckpt"))
    t = _trainer(d / "plugin", plugins=[DistCheckpointIO()])
    t.fit(Small())
    t.save_checkpoint(str(d / "trainer_plugin"))
    fabric = _fabric(plugin=True)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model, opt = fabric.setup(model, opt)
    fabric.save(str(d / "fabric_plugin"), {"model": model, "optimizer": opt, "step": 2})
    return d


def _fabric_load(path):
    fabric = _fabric(plugin=True)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model, opt = fabric.setup(model, opt)
    fabric.load(path, {"model": model, "optimizer": opt})


@pytest.mark.parametrize("name", ["stock.ckpt", "trainer_plugin"])
def test_trainer_checkpoint_into_fabric_plugin_is_fabrics_own_error(written, name):
    """Rows "stock Trainer DDP" and "T+plugin", column F+plugin: Fabric's own KeyError, naming the
    entry ("model") the Trainer's dict does not have."""
    assert os.path.exists(written / name)
    with pytest.raises(KeyError, match="'model'"):
        _fabric_load(str(written / name))


def test_fabric_plugin_checkpoint_into_trainer_plugin_is_refused_naming_the_writer(written):
    """Row F+plugin, column T+plugin: refused, naming fabric.save with DistCheckpointIO and what to do."""
    from lightning_distckpt.core.errors import CheckpointingError
    with pytest.raises(CheckpointingError, match="written by fabric.save with DistCheckpointIO.*fabric.load"):
        t = _trainer(written / "t2", plugins=[DistCheckpointIO()], max_steps=3)
        t.fit(Small(), ckpt_path=str(written / "fabric_plugin"))


# --- cells that need a parallel strategy: one launch of tests/lightning_scripts/matrix_scenarios.py,
# devices=1 (a gloo group of one); each writer saves once and every loader of its row is tried in turn.

@pytest.fixture(scope="module")
def cells(tmp_path_factory):
    from lightning_helpers import run_script
    d = tmp_path_factory.mktemp("borders_matrix_cells")
    (res,) = run_script("matrix_scenarios.py", ["all", "--dir", str(d)], str(d / "out"), world_size=1, timeout=300)
    return res


@pytest.mark.parametrize("key", ["fmp_t_plugin", "ftp_t_plugin"])
def test_fabric_strategy_checkpoints_into_trainer_plugin_are_lightnings_own_error(cells, key):
    """Rows F+TP and Fabric ModelParallel, column T+plugin: Lightning's raw KeyError on its first entry."""
    assert cells[key] == "KeyError: 'pytorch-lightning_version'"


@pytest.mark.parametrize("key", ["tmp_f_plugin", "ttp_f_plugin"])
def test_trainer_strategy_checkpoints_into_fabric_plugin_are_fabrics_own_error(cells, key):
    """Rows T+TP and T+MP, column F+plugin: Fabric's own KeyError naming the missing "model" entry."""
    assert cells[key].startswith("KeyError") and "'model' that does not exist" in cells[key]


def test_trainer_mp_checkpoint_refused_by_fabric_tp(cells):
    """Row T+MP, column F+TP: refused, written by a Trainer, naming trainer.fit and load_module_weights."""
    msg = cells["tmp_f_tp"]
    assert msg.startswith("CheckpointingError") and "written by a Trainer" in msg
    assert "trainer.fit" in msg and "load_module_weights" in msg


def test_tp_strategy_checkpoint_refused_by_trainer_mp(cells):
    """Row T+TP, column T+MP: refused, naming DistCheckpointStrategy as the writer."""
    msg = cells["ttp_t_mp"]
    assert msg.startswith("CheckpointingError") and "written by DistCheckpointStrategy" in msg
    assert "not by DistCheckpointModelParallelStrategy" in msg and "key_map" in msg


def test_stock_fabric_file_refused_by_trainer_mp(cells):
    """Row stock Fabric DDP (torch.save file), column T+MP: refused, written by fabric.save or another tool."""
    msg = cells["sf_t_mp"]
    assert msg.startswith("CheckpointingError") and "written by fabric.save or another tool" in msg


def test_fabric_mp_checkpoint_loads_under_fabric_plugin(cells):
    """Row Fabric ModelParallel, column F+plugin: {"model", "optimizer"} weights and Adam moments
    bit-exact against the writer's tensors (module keys, torch's optimizer layout)."""
    assert cells["fmp_f_plugin"] == "ok"
    equal = cells["fmp_f_plugin_equal"]
    assert len(equal) == 16 and all(equal.values()), equal


def test_fabric_mp_checkpoint_into_fabric_tp_is_refused_naming_the_writer(cells):
    """Row Fabric ModelParallel, column F+TP: refused, naming the strategy that wrote it and what to do."""
    cell = cells["fmp_f_tp"]
    assert cell.startswith("CheckpointingError"), cell
    assert "written by FabricDistCheckpointModelParallelStrategy" in cell and "load_module_weights" in cell


def test_fabric_mp_checkpoint_weights_by_load_module_weights(cells):
    """Row Fabric ModelParallel, column inference: load_module_weights(m, dir, entry="model"), bit-exact."""
    assert cells["fmp_inference"] == "ok"
    assert cells["fmp_inference_keys"] == ["fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight"]
    assert len(cells["fmp_inference_equal"]) == 4 and all(cells["fmp_inference_equal"].values())


def test_trainer_plugin_directory_loads_under_fabric_tp(cells):
    """Row T+plugin, column F+TP: as the stock file, into {"model", "optimizer"}: weights equal the stored ones."""
    assert cells["tpl_f_tp"] == "ok"
    assert len(cells["tpl_f_tp_equal"]) == 4 and all(cells["tpl_f_tp_equal"].values()), cells["tpl_f_tp_equal"]


def test_lightning_dcp_directory_refused_by_trainer_mp(cells):
    """Row Lightning ModelParallelStrategy (DCP directory), column T+MP: refused, not written by lightning_distckpt."""
    msg = cells["dcp_t_mp"]
    assert msg.startswith("CheckpointingError") and "not by lightning_distckpt" in msg and "key_map" in msg


def test_lightning_dcp_directory_refused_by_fabric_tp(cells):
    """Row Lightning ModelParallelStrategy (DCP directory), column F+TP: refused, written by a Trainer."""
    msg = cells["dcp_f_tp"]
    assert msg.startswith("CheckpointingError") and "written by a Trainer" in msg and "load_module_weights" in msg
