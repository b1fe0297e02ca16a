"""``ModelCheckpoint(save_last="link")`` with async saves, when a save fails in the background.

Lightning links ``last.ckpt`` to each checkpoint as its save is issued. Before, an async save that then
failed (a full disk) left ``last.ckpt`` pointing at nothing, and the next run's ``ckpt_path="last"``
started from scratch although the checkpoint before it had committed. Now the failure, when raised,
points the link back at the newest committed checkpoint (``lightning/last_link.py``) and the next run
resumes there. A full disk is stood for by a file-size limit (``RLIMIT_FSIZE``, soft limit only, in a
child process) set once the first checkpoint committed.
"""

import json
import os
import subprocess
import sys

import pytest

from lightning_distckpt.lightning.last_link import repoint_last_links

FIT = """
import json, os, resource, signal, sys
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel
import lightning_distckpt as ldc
from lightning_distckpt.lightning import DistCheckpointIO

folder = sys.argv[1]
last_name = sys.argv[2] if len(sys.argv) > 2 else "last"  # a custom CHECKPOINT_NAME_LAST
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write beyond the limit fails with EFBIG instead
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)

class FillDiskAfterFirstCheckpoint(Callback):
    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step == 3:
            trainer.strategy.checkpoint_io.wait()  # step 2's checkpoint committed
            resource.setrlimit(resource.RLIMIT_FSIZE, (64, hard))

def trainer(steps, *callbacks):
    mc = ModelCheckpoint(folder, every_n_train_steps=2, save_top_k=-1, save_last="link")
    mc.CHECKPOINT_NAME_LAST = last_name  # Lightning's documented way to rename the last checkpoint
    return Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_progress_bar=False,
                   enable_model_summary=False, plugins=[DistCheckpointIO({"async_save": True})],
                   callbacks=[mc, *callbacks])

out = {}
try:
    trainer(6, FillDiskAfterFirstCheckpoint()).fit(BoringModel())
    out["first"] = "finished"
except ldc.SaveFailedError as e:
    out["first"] = "SaveFailedError"
resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
last = os.path.join(folder, last_name + ".ckpt")
out["link"] = os.readlink(last) if os.path.islink(last) else None
resumed = trainer(6)
resumed.fit(BoringModel(), ckpt_path="last")
out["resumed_from"] = resumed.ckpt_path and os.path.basename(resumed.ckpt_path)
print(json.dumps(out))
"""


def test_a_failed_async_save_leaves_last_pointing_at_the_previous_checkpoint(tmp_path):
    folder = tmp_path / "ckpts"
    proc = subprocess.run([sys.executable, "-c", FIT, str(folder)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["first"] == "SaveFailedError", out
    assert out["link"] == "epoch=0-step=2.ckpt", out  # was epoch=0-step=4.ckpt, which never committed
    assert out["resumed_from"] == "last.ckpt", out  # before: None, a fit from scratch


def _committed(path) -> None:
    """A committed checkpoint of ours at ``path``."""
    import torch

    import lightning_distckpt as ldc

    ldc.save({"w": ldc.ShardedTensor.from_rank_offsets("w", torch.zeros(4))}, str(path))


def test_only_last_links_to_the_failed_target_change(tmp_path):
    _committed(tmp_path / "a.ckpt")
    failed = tmp_path / "b.ckpt"
    for name, to in [("last.ckpt", "b.ckpt"), ("last-v1.ckpt", "b.ckpt"), ("mine", "b.ckpt"),
                     ("last-v2.ckpt", "a.ckpt")]:
        os.symlink(to, tmp_path / name)
    assert sorted(repoint_last_links(str(failed))) == ["last-v1.ckpt", "last.ckpt"]
    links = {n: os.readlink(tmp_path / n) for n in os.listdir(tmp_path) if os.path.islink(tmp_path / n)}
    assert links == {"last.ckpt": "a.ckpt", "last-v1.ckpt": "a.ckpt", "mine": "b.ckpt", "last-v2.ckpt": "a.ckpt"}
    assert sorted(os.listdir(tmp_path)) == sorted(["a.ckpt", *links])  # no temporary left


@pytest.mark.parametrize("there", ["nothing committed beside it", "the target exists"])
def test_links_stay_when_there_is_nothing_better(tmp_path, there):
    failed = tmp_path / "b.ckpt"
    if there == "the target exists":
        _committed(tmp_path / "a.ckpt")
        os.makedirs(failed)
    os.symlink("b.ckpt", tmp_path / "last.ckpt")
    assert repoint_last_links(str(failed)) == []
    assert os.readlink(tmp_path / "last.ckpt") == "b.ckpt"
