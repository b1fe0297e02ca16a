"""Red team of the tiers' "a fit that does not resume from the marker is a new run" rule: a restart of the SAME
job must keep its run (its local steps, its marker) and not be warned at, however Lightning restarts it.

* **The marker given as a relative path, or through a linked folder** (``ModelCheckpoint`` keeps its folder as
  ``realpath``): compared as spelled, these resumed from the marker (the load asks the tiers), then were taken as
  "not resuming": a WARNING that another job's steps are not resumed, the marker removed and a new run started,
  so a crash before the next local save lost this job's local steps to ``ckpt_path="last"``.
* **SLURM auto-requeue** (Lightning resumes the requeued job from ``hpc_ckpt_<N>.ckpt``, here ``ckpt_path="hpc"``,
  what it resolves to): the same job, requeued; it was warned at and its marker removed.
* **A second ``trainer.fit`` of the same Trainer** after one that resumed with ``"last"``: the run is this job's,
  yet it was taken for another job's (warning, marker removed).

Real 2-process Trainer fits (gloo, 2 simulated nodes), real files; no timing is relied on.
"""

import json
import os
import sys

from lightning_helpers import run_ranks
from script_ranks import script_env

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = r'''
import json, logging, os, sys
from datetime import timedelta
sys.path.insert(0, TESTS)
import torch
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from lightning_distckpt.lightning import DistCheckpointStrategy

work, out = sys.argv[1], sys.argv[2]
rank = int(os.environ["LOCAL_RANK"])
root = os.path.join(work, "root")
marker = os.path.join(root, "checkpoints", "tiers-last.json")
warnings = []


class Catch(logging.Handler):
    def emit(self, record):
        if record.levelno >= logging.WARNING:
            warnings.append(record.getMessage())


logging.getLogger("lightning_distckpt").addHandler(Catch())


class Model(LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 3)

    def training_step(self, batch, batch_idx):
        return self.layer(batch).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.randn(64, 4, generator=torch.Generator().manual_seed(0)),
                                           batch_size=2)


class Seen(Callback):
    def on_train_start(self, trainer, module):
        self.first = trainer.global_step


def marker_run():
    if not os.path.isfile(marker):
        return None
    with open(marker) as f:
        return json.load(f).get("run")


def fit(steps, ckpt_path=None, trainer=None, model=None):
    seen = Seen()
    if trainer is None:
        seed_everything(1)
        tiers = {"local_dir": os.path.join(work, "local", "{node}"), "local_every_n_steps": 1, "keep_local": 2,
                 "ranks_per_node": 1, "replicas": 1}
        model = Model()
        trainer = Trainer(accelerator="cpu", devices=2, max_steps=steps, logger=False, enable_progress_bar=False,
                          strategy=DistCheckpointStrategy(timeout=timedelta(seconds=30), checkpoint={"tiers": tiers}),
                          enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0,
                          callbacks=[seen], default_root_dir=root)
    else:
        trainer.callbacks.append(seen)
        trainer.fit_loop.epoch_loop.max_steps = steps
    del warnings[:]
    trainer.fit(model, ckpt_path=ckpt_path)
    trainer.strategy.barrier()
    res = {"first": seen.first, "run": marker_run(), "warnings": list(warnings)}
    trainer.strategy.barrier()  # every rank read the marker before the next fit may change it
    return res, trainer, model


res = {}
res["a"], _, _ = fit(2)                                              # the job: local steps 1, 2, its marker
res["relative"], _, _ = fit(3, os.path.relpath(marker))              # restarted, the marker as a relative path
res["linked"], _, _ = fit(4, os.path.join(work, "link", "checkpoints", "tiers-last.json"))  # a linked folder
res["last"], trainer, model = fit(5, "last")
trainer.save_checkpoint(os.path.join(root, "hpc_ckpt_1.ckpt"))       # what SLURM's signal saves at step 5
res["again"], _, _ = fit(6, None, trainer, model)                    # the same Trainer fits on
res["hpc"], _, _ = fit(7, "hpc")                                     # the requeued job resumes from hpc_ckpt_1
res["after"], _, _ = fit(8, "last")                                  # and restarts again: its local step 7
with open(f"{out}.rank{rank}.json", "w") as f:
    json.dump(res, f)
'''.replace("TESTS", repr(TESTS))


def test_a_restart_of_the_same_job_keeps_its_run_unwarned(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    work = tmp_path / "work"
    (work / "root").mkdir(parents=True)
    os.symlink(work / "root", work / "link")
    out = str(tmp_path / "out")
    code, output = run_ranks(str(script), [str(work), out], script_env(), 2, timeout=300)
    assert code == 0, output[-6000:]
    for r in range(2):
        with open(f"{out}.rank{r}.json") as f:
            res = json.load(f)
        run = res["a"]["run"]
        assert run is not None and res["a"]["first"] == 0, res
        expected_first = {"relative": 2, "linked": 3, "last": 4, "again": 5, "hpc": 5, "after": 7}
        for name, first in expected_first.items():
            # before: "relative", "linked", "again", "hpc" warned that another run's steps are not resumed and
            # removed the marker (run None), and "after" resumed nothing of the job's local steps
            assert res[name]["warnings"] == [], (name, res[name])
            assert res[name]["run"] == run, (name, res)
            assert res[name]["first"] == first, (name, res)


if __name__ == "__main__":
    import pytest

    sys.exit(pytest.main([__file__, "-q"]))
