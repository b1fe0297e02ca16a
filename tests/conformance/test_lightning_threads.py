"""Threads a fit leaves behind: Lightning's test suites fail a test that leaves a thread running,
unless it is a daemon with a ``stop()`` that ends it (their fixture stops such threads between
tests). Ours (the kept fsync, blob and O_DIRECT writer threads) follow that convention: after fits
that save with the plugin and the strategy, synchronously and in the background, in both layouts,
every thread the fit left is a daemon whose ``stop()`` ends it."""

from __future__ import annotations

import threading

import pytest
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_distckpt.lightning import DistCheckpointIO, DistCheckpointStrategy
from lightning_helpers import TPMLP, quiet_trainer


@pytest.mark.parametrize("how", ["plugin", "strategy"])
@pytest.mark.parametrize("config", [{}, {"async_save": True}, {"storage": {"layout": "zarr"}}],
                         ids=["sync", "async", "zarr"])
def test_threads_a_fit_leaves_are_daemons_that_stop(tmp_path, isolated_process_group, how, config):
    before = set(threading.enumerate())
    kwargs = dict(plugins=[DistCheckpointIO(config)]) if how == "plugin" else \
        dict(strategy=DistCheckpointStrategy(checkpoint=config))
    ck = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=-1)
    trainer = quiet_trainer(max_steps=3, callbacks=[ck], **kwargs)
    trainer.fit(TPMLP(d_in=256, d_hidden=512, total_steps=3))  # fc1: 512 KiB, written with O_DIRECT in zarr
    left = [t for t in set(threading.enumerate()) - before  # Lightning's own (its launcher's observer) aside
            if t.is_alive() and not type(t).__module__.startswith("lightning.")]
    assert [p for p in tmp_path.iterdir() if p.name.endswith(".ckpt")]  # it saved
    for t in left:
        assert t.daemon and callable(getattr(t, "stop", None)), f"{t.name} is left running and cannot be stopped"
        t.stop()
        assert not t.is_alive(), t.name
