"""A save warns, at once, when its common state or a ShardedObject holds a type a load will refuse
(loading runs no code: saving/load_check.py), instead of the run finding out at its first resume.
Nothing is warned where the load would succeed, or where the run's loads allow the type."""

from __future__ import annotations

import collections
import dataclasses
import logging

import pytest
import torch
from omegaconf import OmegaConf

import lightning_distckpt as ldc
from lightning_distckpt.saving.save_prepare import SavePlanCache

LOGGER = "lightning_distckpt.saving.load_check"


@dataclasses.dataclass
class Hparams:
    lr: float = 0.1


@dataclasses.dataclass
class Opts:
    layers: int = 2


def _said(caplog) -> list:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER]


def _state(**common):
    return {"w": ldc.ShardedTensor.from_rank_offsets("w", torch.arange(4.0)), **common}


def test_a_user_type_in_the_common_state_is_named_at_save_and_the_load_then_refuses_it(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        ldc.save(_state(hparams=Hparams()), tmp_path / "c")
    said = _said(caplog)
    assert len(said) == 1, said
    assert f"{__name__}.Hparams" in said[0] and "extra_safe_globals" in said[0] and "common.pt" in said[0]
    assert "save to" in said[0] and "resume" in said[0]
    with pytest.raises(ldc.UnsafeContentError, match="Hparams"):  # what the warning foretold
        ldc.load({}, tmp_path / "c")
    state = ldc.load({}, tmp_path / "c", extra_safe_globals=[Hparams])
    assert state["hparams"] == Hparams()


def test_a_sharded_object_holding_a_refused_type_is_named(tmp_path, caplog):
    # (not argparse.Namespace: importing megatron-core, as other tests do, allow-lists it for the process)
    so = ldc.ShardedObject("opts", Opts(), (1,), (0,))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        ldc.save({"opts": so}, tmp_path / "c")
    said = _said(caplog)
    assert len(said) == 1 and "ShardedObject 'opts'" in said[0] and f"{__name__}.Opts" in said[0], said


def test_what_loads_is_not_warned_about(tmp_path, caplog):
    """Tensors, dtypes, devices, sizes, ordered dicts, omegaconf configs, and a string whose bytes look like a
    pickle's global (the check then loads it once, and finds nothing to say)."""
    common = dict(t=torch.ones(2), dtype=torch.bfloat16, device=torch.device("cpu"), size=torch.Size([2, 3]),
                  od=collections.OrderedDict(a=1), cfg=OmegaConf.create({"lr": 0.1, "layers": [1, 2]}),
                  text="cfoo\nbar\n", n=None, pair=(1, 2.5), raw=b"\x00c")
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        ldc.save(_state(**common), tmp_path / "c")
    assert _said(caplog) == []
    assert ldc.load({}, tmp_path / "c")["text"] == "cfoo\nbar\n"


def test_a_run_says_it_once_and_not_for_a_type_its_loads_allow(tmp_path, caplog):
    cache = SavePlanCache()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        for i in range(3):
            ldc.save(_state(hparams=Hparams(lr=i)), tmp_path / f"c{i}", plan_cache=cache)
    assert len(_said(caplog)) == 1
    caplog.clear()
    allowed = SavePlanCache(load_safe_globals=[Hparams])
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        ldc.save(_state(hparams=Hparams()), tmp_path / "d", plan_cache=allowed)
    assert _said(caplog) == []


def test_under_the_trainer_the_plugin_warns_unless_its_loads_allow_the_type(tmp_path, caplog):
    """A LightningModule's save_hyperparameters() of a dataclass: stock Lightning's resume fails in torch's
    weights-only load; ours says so at the first save, and not when the plugin allows the type."""
    from lightning.pytorch import LightningModule, Trainer
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_distckpt.lightning import DistCheckpointIO

    class Module(LightningModule):
        def __init__(self, opts: Hparams = Hparams()):
            super().__init__()
            self.save_hyperparameters()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch, _):
            return self.layer(batch[0]).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=2)

    def fit(root, plugin, **kw):
        trainer = Trainer(plugins=[plugin], max_steps=2, logger=False, enable_progress_bar=False,
                          enable_model_summary=False, default_root_dir=root, accelerator="cpu", devices=1)
        trainer.fit(Module(), data, **kw)
        return trainer

    with caplog.at_level(logging.WARNING, logger=LOGGER):
        fit(tmp_path / "a", DistCheckpointIO())
    said = _said(caplog)
    assert len(said) == 1 and "Hparams" in said[0], said
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        first = fit(tmp_path / "b", DistCheckpointIO(extra_safe_globals=[Hparams]))
        ckpt = first.checkpoint_callback.best_model_path
        resumed = fit(tmp_path / "b", DistCheckpointIO(extra_safe_globals=[Hparams]), ckpt_path=ckpt)
    assert _said(caplog) == []
    assert resumed.global_step == 2 and resumed.lightning_module.hparams.opts == Hparams()
