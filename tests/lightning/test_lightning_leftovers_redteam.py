"""Lightning leftovers: a custom ``CHECKPOINT_NAME_LAST`` link after a failed async save, and torn stock
``.ckpt`` files met by the tiers' search for the newest durable checkpoint and by a resume.

1. ``ModelCheckpoint(save_last="link")`` links its last name to each checkpoint as its save is issued.
   When an async save then fails, only links named ``last*.ckpt`` were pointed back at the newest committed
   checkpoint: with Lightning's documented ``CHECKPOINT_NAME_LAST = "final"`` the link dangled and the next
   ``ckpt_path="last"`` started from scratch. A full disk is stood for by ``RLIMIT_FSIZE`` in a child process.
2. A torn stock ``.ckpt`` (cut short, or a span zeroed) is passed over by the tiers' durable candidates with a
   warning naming it (every zip record's CRC-32 is checked when its common state is read), and a resume from
   it fails loudly, where ``torch.load`` itself returns the zeroed tensor silently.
"""

import json
import logging
import os
import subprocess
import sys

import pytest
import torch

import lightning_distckpt as ldc
from lightning_distckpt.lightning import DistCheckpointIO, DistCheckpointStrategy
from lightning_distckpt.lightning import last_link
from lightning_distckpt.lightning.tiers_restore import durable_step
from trust.test_trust_last_link import FIT  # its fit, given a custom last name


def test_a_failed_async_save_repoints_a_custom_last_name(tmp_path):
    folder = tmp_path / "ckpts"
    proc = subprocess.run([sys.executable, "-c", FIT, str(folder), "final"], capture_output=True,
                          text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["first"] == "SaveFailedError", out
    assert out["link"] == "epoch=0-step=2.ckpt", out  # before: epoch=0-step=4.ckpt, which never committed
    assert out["resumed_from"] == "final.ckpt", out  # before: None, a fit from scratch


def _committed(path) -> None:
    ldc.save({"w": ldc.ShardedTensor.from_rank_offsets("w", torch.zeros(4))}, str(path))


def test_links_made_while_the_save_was_in_flight_are_repointed_a_users_own_are_not(tmp_path):
    _committed(tmp_path / "a.ckpt")
    failed = tmp_path / "b.ckpt"
    os.symlink("b.ckpt", tmp_path / "mine")  # the user's, there before the save was issued
    before = last_link.links_to_target(str(failed))
    assert before == ["mine"]
    for name in ("epoch=0-last.ckpt", "final.ckpt", "last.ckpt"):  # ModelCheckpoint's, made after the save
        os.symlink("b.ckpt", tmp_path / name)
    assert sorted(last_link.repoint_last_links(str(failed), before)) == ["epoch=0-last.ckpt", "final.ckpt", "last.ckpt"]
    links = {n: os.readlink(tmp_path / n) for n in os.listdir(tmp_path) if os.path.islink(tmp_path / n)}
    assert links == {"mine": "b.ckpt", "epoch=0-last.ckpt": "a.ckpt", "final.ckpt": "a.ckpt", "last.ckpt": "a.ckpt"}
    assert sorted(os.listdir(tmp_path)) == sorted(["a.ckpt", *links])  # no temporary left


def _stock(path, damage: str) -> None:
    """A stock Lightning-like ``.ckpt`` (``torch.save``), ``damage``: as saved, cut short, or a span zeroed."""
    torch.save({"state_dict": {"w": torch.arange(1, 100001, dtype=torch.float32)}, "global_step": 4,
                "callbacks": {}, "loops": {}}, str(path))
    data = bytearray(path.read_bytes())
    n = len(data)
    if damage == "cut short":
        data = data[: n // 2]
    elif damage == "zeroed":
        data[n // 3: n // 3 + 4096] = bytes(4096)  # inside the tensor's record; the zip directory intact
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", ["cut short", "zeroed"])
def test_a_torn_stock_ckpt_is_no_durable_candidate_and_is_named(tmp_path, damage, caplog):
    good, torn = tmp_path / "good.ckpt", tmp_path / "torn.ckpt"
    _stock(good, "none")
    _stock(torn, damage)
    strategy = DistCheckpointStrategy()
    assert durable_step(strategy, str(good)) == 4
    with caplog.at_level(logging.WARNING, logger="lightning_distckpt.lightning.tiers_restore"):
        assert durable_step(strategy, str(torn)) is None  # passed over for the next-newest candidate
    assert any(str(torn) in r.getMessage() and "not a candidate" in r.getMessage() for r in caplog.records)


def test_a_zeroed_stock_ckpt_fails_loudly_where_torch_load_reads_zeros(tmp_path):
    torn = tmp_path / "torn.ckpt"
    _stock(torn, "zeroed")
    silently = torch.load(str(torn), weights_only=True)["state_dict"]["w"]
    assert (silently == 0).any()  # stock Lightning's torch.load: zeros resumed, no error
    with pytest.raises(ldc.FormatError, match="CRC-32"):
        DistCheckpointIO().load_checkpoint(str(torn))
