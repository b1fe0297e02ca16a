"""Two jobs, one after the other, given one node-local ``local_dir`` and one checkpoint folder (the same
``default_root_dir``, so the same ``tiers-last.json``): the later job must never resume the earlier one's
local steps as its own.

* **A fit that starts fresh** (``ckpt_path=None``, or an explicit checkpoint) in a folder whose marker names
  another run used to adopt that run: its own durable saves and a restart with ``ckpt_path="last"`` then
  resumed the EARLIER job's newer local step (its weights, this job's model), with no warning. Now a fit that
  does not resume from the marker starts a new run: the marker is removed as training starts (a WARNING names
  it, the other run's steps and the local directory) and its first local save writes its own.
* **A fit of another model shape with ``ckpt_path="last"``** (asking to resume the folder's run): refused by
  the load's own checks, a clear error naming the key and the shapes, on every rank; not a crash.
* Sound, kept: a restart of the same job with ``ckpt_path="last"`` resumes its own newest local step.

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
warnings = []


class Catch(logging.Handler):
    def emit(self, record):
        if record.levelno >= logging.WARNING:
            warnings.append(record.getMessage())


logging.getLogger("lightning_distckpt").addHandler(Catch())


class Model(LightningModule):
    def __init__(self, width):
        super().__init__()
        self.layer = torch.nn.Linear(4, width)

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
        self.weight = module.layer.weight.detach().clone()


def fit(width, seed, steps, ckpt_path=None, local_every=1, durable_every=None):
    seed_everything(seed)
    tiers = {"local_dir": os.path.join(work, "local", "{node}"), "local_every_n_steps": local_every,
             "keep_local": 2, "ranks_per_node": 1, "replicas": 1, "durable_every_n_steps": durable_every}
    seen, model = Seen(), Model(width)
    trainer = Trainer(accelerator="cpu", devices=2, max_steps=steps, logger=False, enable_progress_bar=False,
                      strategy=DistCheckpointStrategy(timeout=timedelta(seconds=30), checkpoint={"tiers": tiers}),
                      enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0,
                      callbacks=[seen], default_root_dir=os.path.join(work, "root"))
    del warnings[:]
    try:
        trainer.fit(model, ckpt_path=ckpt_path)
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"}
    return {"first": seen.first, "start": seen.weight.tolist(), "end": model.layer.weight.tolist(),
            "warnings": list(warnings)}


res = {}
res["a"] = fit(3, 1, 6)                                 # job A: local steps 5, 6 kept
# job B (same shape, another seed), fresh; a durable last.ckpt at step 2, no local save yet; then it stops
res["b"] = fit(3, 2, 2, local_every=4, durable_every=2)
res["b_again"] = fit(3, 2, 4, "last", local_every=4, durable_every=2)  # B's restart
res["c"] = fit(5, 3, 6)                                 # job C (another shape), fresh: local steps 5, 6
res["c_again"] = fit(5, 3, 7, "last")                   # C's restart: its own step 6 (B's last.ckpt: 4)
res["d"] = fit(7, 4, 2, "last")                         # job D, another shape, asks for the folder's "last"
with open(f"{out}.rank{rank}.json", "w") as f:
    json.dump(res, f)
'''.replace("TESTS", repr(TESTS))


def test_a_later_job_never_resumes_an_earlier_jobs_local_steps(tmp_path):
    script = tmp_path / "jobs.py"
    script.write_text(SCRIPT)
    out = str(tmp_path / "out")
    code, output = run_ranks(str(script), [str(tmp_path / "work"), out], script_env(), 2, timeout=300)
    assert code == 0, output[-6000:]
    results = []
    for r in range(2):
        with open(f"{out}.rank{r}.json") as f:
            results.append(json.load(f))
    for res in results:
        assert res["a"]["first"] == 0 and res["b"]["first"] == 0, res
        # before: B's restart resumed A's local step 6 (A's weights), where B's own newest save is its step 2
        assert res["b_again"]["first"] == 2 and res["b_again"]["start"] == res["b"]["end"] != res["a"]["end"], res
        # B's fit found A's marker: it says it starts a new run and names the other run's steps
        warned = [w for w in res["b"]["warnings"] if "tiers-last.json" in w and "not resumed" in w]
        assert len(warned) == 1 and os.path.join(str(tmp_path), "work", "local") in warned[0], res["b"]
        # C, another shape, fresh: its own run; its restart resumes its own local step 6 (the feature)
        assert res["c"]["first"] == 0 and "error" not in res["c_again"], res
        assert res["c_again"]["first"] == 6 and res["c_again"]["start"] == res["c"]["end"], res
        # D asks for the folder's "last" (C's step 7) with another shape: refused by the load, clearly
        error = res["d"].get("error", "")
        assert "layer.weight" in error and "shape" in error.lower(), res["d"]


if __name__ == "__main__":
    import pytest

    sys.exit(pytest.main([__file__, "-q"]))
