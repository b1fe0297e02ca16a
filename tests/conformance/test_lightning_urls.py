"""A checkpoint folder we cannot save to (``memory://`` and other fsspec URLs but ``s3://``) is refused
at setup, before any training step, naming what is supported; not at the first save an epoch later."""

from __future__ import annotations

import pytest
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_distckpt.core.errors import ArgumentError
from lightning_distckpt.lightning import DistCheckpointIO, DistCheckpointStrategy, DistModelCheckpoint
from lightning_helpers import TPMLP, quiet_trainer

SUPPORTED = "a local or shared file-system path or to an s3:// URL"


@pytest.mark.parametrize("how", ["strategy", "plugin"])
def test_a_memory_url_is_refused_at_setup(isolated_process_group, how):
    if how == "strategy":  # any ModelCheckpoint: the strategy checks every checkpoint callback's folder
        trainer = quiet_trainer(strategy=DistCheckpointStrategy(), max_steps=2,
                                callbacks=[ModelCheckpoint(dirpath="memory://run/ckpts")])
    else:  # a stock strategy saves through the plugin only: our ModelCheckpoint checks its own folder
        trainer = quiet_trainer(plugins=[DistCheckpointIO()], max_steps=2,
                                callbacks=[DistModelCheckpoint(dirpath="memory://run/ckpts")])
    model = TPMLP(total_steps=2)
    with pytest.raises(ArgumentError) as refused:
        trainer.fit(model)
    assert model.losses == {}  # no step was trained
    message = str(refused.value)
    assert "memory://run/ckpts" in message and "memory:// URLs are not supported" in message and SUPPORTED in message
    assert "no object-store backend" not in message


def test_the_plugin_names_what_is_supported():
    with pytest.raises(ArgumentError, match="gs:// URLs are not supported; a checkpoint goes to " + SUPPORTED):
        DistCheckpointIO().save_checkpoint({"state_dict": {}}, "gs://bucket/ckpt")
