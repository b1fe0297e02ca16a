"""Red team: Lightning's ``ModelCheckpoint`` and the Trainer's checkpoint paths with ``DistCheckpointIO``,
``DistCheckpointStrategy`` and ``DistCheckpointModelParallelStrategy``, each compared with stock Lightning
(``TorchCheckpointIO``) on the same input: what a red-team probe found.

* **A monitored metric that differs by rank** (``self.log("loss", ...)`` without ``sync_dist``, Lightning's
  default for step-level metrics): stock DDP saves rank 0's checkpoint whole, each rank keeping its own
  ``best_k_models``. Our strategies save every rank's tree together, and the plain tensors of the callback
  states (``best_k_models`` scores keyed by file name, ``best_model_score``, ``EarlyStopping.best_score``) were
  stored as replicated tensors keyed by their paths, written by whichever rank the plan picked. With the
  metric in the file name (``filename="{step}-{loss:.2f}"``) rank 1's ``best_k_models`` key is another path:
  the first save of the run failed with ``ValidationError: ... main replicas cover 0 of 1 elements`` (stock
  trains on); without it the checkpoint silently held rank 1's scores beside rank 0's paths. Now those
  tensors are rank 0's (``lightning/tree.py: rank_zero_tensors``), as stock saves them.
* **A file inside one of our checkpoints as ``ckpt_path``** (``last.ckpt/common.pt``, the one file of ours
  that is a ``torch.save`` archive): read as a stock ``.ckpt``, it failed on Lightning's bare
  ``KeyError: 'state_dict'`` (plugin) or a missing-keys error (strategy), naming no checkpoint; now a
  ``FormatError`` names the checkpoint directory to pass, as ``metadata.json`` or ``data/`` already did.
* **``ckpt_path="last"`` on ``s3://`` passed over ``last-v1.ckpt``**: the version counter names a callback's
  last checkpoint ``last-v1.ckpt`` when ``last.ckpt`` is another's (a second callback, or one whose arguments
  changed between runs, whose state is then not restored); Lightning's listing counts it among the last ones
  and a local ``ckpt_path="last"`` resumes the newer. ``DistModelCheckpoint``'s own listing (``s3://``, and the
  recovery of a local commit cut between its renames) took only ``last-<digits>``: the run silently resumed
  the older ``last.ckpt``. Now ``last-vN`` counts too (``model_checkpoint.py``).

Found sound, each against stock on the same input: filename templates giving ``/`` (a sub-folder), ``..``,
``=`` and spaces; a NaN monitor (kept as +-inf, never deleting the best) and ties in ``save_top_k``; two
``ModelCheckpoint`` callbacks in one folder (``last``/``last-v1``, "last" the newer); ``save_weights_only``
and ``trainer.save_checkpoint(weights_only=True)`` then ``validate`` / ``test`` / ``fit`` (refused in
Lightning's words); ``validate(ckpt_path=...)`` on 2 ranks, DDP + plugin and the strategy in both directions;
``fit`` raising right after a save (sync and async: committed, ``ckpt_path="last"`` resumes it); a folder
moved, copied with ``cp -r``, ``cp -rL`` or without its links (an mtime order lost in a copy picks "last" as
stock does); ``metadata.json`` / ``COMMITTED`` / ``data`` as ``ckpt_path``. A folder holding a stock ``.ckpt``
or a directory of the user's under a checkpoint's name: with the version counter (the default) ours and
stock write ``-v1`` beside it; without it stock overwrites the file and its top-k removal deletes the
directory, ours refuses the save and keeps both (kept below).
"""

import json
import os

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel
from script_ranks import run_ranks, script_env

from lightning_distckpt.core.errors import CheckpointingError, FormatError
from lightning_distckpt.lightning import DistCheckpointIO, DistCheckpointStrategy, DistModelCheckpoint
from lightning_helpers import quiet_trainer

# Two ranks each logging its own value of "m" (no sync_dist), ModelCheckpoint naming files after it and
# EarlyStopping watching it: stock DDP, then our strategies, each resumed from "last".
PER_RANK_METRIC = r'''
import json, logging, os, sys, warnings
from datetime import timedelta
warnings.filterwarnings("ignore")
for name in ("lightning.pytorch", "lightning.fabric", "lightning_distckpt"):
    logging.getLogger(name).setLevel(logging.ERROR)
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel
from torch.distributed.fsdp import fully_shard
from lightning_distckpt.lightning import DistCheckpointIO, DistCheckpointModelParallelStrategy, DistCheckpointStrategy

root, out = sys.argv[1], sys.argv[2]
TIMEOUT = timedelta(seconds=30)  # a hang guard: an agreed error comes well within it


class PerRank(BoringModel):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("m", float(self.global_rank + 10 * self.global_step))  # each rank its own value
        return loss

    def configure_model(self):
        if self.device_mesh is not None:  # DistCheckpointModelParallelStrategy: FSDP2 over both ranks
            fully_shard(self.layer, mesh=self.device_mesh["data_parallel"])
            fully_shard(self, mesh=self.device_mesh["data_parallel"])


def strategy(how):
    if how == "ddp":
        return "ddp"
    if how == "model_parallel":
        return DistCheckpointModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1, timeout=TIMEOUT)
    return DistCheckpointStrategy(timeout=TIMEOUT)


def fit(how, folder, filename, max_steps, ckpt_path=None):
    mc = ModelCheckpoint(dirpath=folder, monitor="m", mode="max", every_n_train_steps=1, save_top_k=2,
                         filename=filename, save_last=True)
    es = EarlyStopping(monitor="m", mode="max", patience=100, check_on_train_epoch_end=True)
    trainer = Trainer(accelerator="cpu", devices=2, strategy=strategy(how), max_steps=max_steps, limit_train_batches=2,
                      limit_val_batches=0, callbacks=[mc, es], logger=False, enable_progress_bar=False,
                      enable_model_summary=False)
    trainer.fit(PerRank(), ckpt_path=ckpt_path)
    return trainer


def scores(path):
    """The callbacks' tensors as saved, by callback class (file names by their base name)."""
    out = {}
    for key, state in DistCheckpointIO().load_checkpoint(path)["callbacks"].items():
        out[key.split("{")[0]] = {
            name: value.item() if isinstance(value, torch.Tensor) else
            {os.path.basename(p): s.item() for p, s in value.items()}
            for name, value in state.items() if name in ("best_score", "best_model_score", "current_score",
                                                         "kth_value", "best_k_models")}
    return out


res = {}
for how, filename in (("ddp", "{step}-{m:.0f}"), ("strategy", "{step}-{m:.0f}"), ("model_parallel", "{step}-{m:.0f}"),
                      ("strategy", "{step}")):
    case = f"{how} {filename}"
    folder = os.path.join(root, how + str(len(filename)))
    try:
        fit(how, folder, filename, 3)
        torch.distributed.barrier()
        res[case] = {"files": sorted(os.listdir(folder)), "scores": scores(os.path.join(folder, "last.ckpt"))}
        if how != "ddp" and filename != "{step}":
            res[case]["resumed_to"] = fit(how, folder, filename, 4, "last").global_step
    except Exception as e:
        res[case] = f"{type(e).__name__}: {e}"
with open(f"{out}.rank{os.environ['LOCAL_RANK']}.json", "w") as f:
    json.dump(res, f)
'''

# What stock DDP saved at step 3: rank 0's values of "m" (10 x the step before the save, + its rank 0).
STOCK_SCORES = {"EarlyStopping": {"best_score": 10.0},
                "ModelCheckpoint": {"best_model_score": 20.0, "current_score": 20.0, "kth_value": 10.0,
                                    "best_k_models": {"step=2-m=10.ckpt": 10.0, "step=3-m=20.ckpt": 20.0}}}


def test_a_metric_that_differs_by_rank_is_saved_as_stock_saves_it(tmp_path):
    script = tmp_path / "per_rank.py"
    script.write_text(PER_RANK_METRIC)
    code, output = run_ranks(str(script), [str(tmp_path), str(tmp_path / "out")], script_env(), 2, timeout=300)
    for rank in range(2):
        path = tmp_path / f"out.rank{rank}.json"
        assert path.is_file(), f"rank {rank} wrote no results (exit {code}):\n{output[-6000:]}"
        res = json.loads(path.read_text())
        assert res["ddp {step}-{m:.0f}"] == {"files": ["last.ckpt", "step=2-m=10.ckpt", "step=3-m=20.ckpt"],
                                            "scores": STOCK_SCORES}, (rank, res)
        for how in ("strategy", "model_parallel"):
            # before: "ValidationError: sharded state dict for checkpoint .../step=1-m=0.ckpt is inconsistent;
            # nothing was written: ...best_k_models//.../step=1-m=1.ckpt: main replicas cover 0 of 1 elements"
            assert res[f"{how} {{step}}-{{m:.0f}}"] == {**res["ddp {step}-{m:.0f}"], "resumed_to": 4}, (rank, how, res)
        # before: rank 1's scores (11, 21, 11) saved beside rank 0's file names
        unnamed = res["strategy {step}"]
        assert unnamed["files"] == ["last.ckpt", "step=2.ckpt", "step=3.ckpt"], (rank, unnamed)
        assert unnamed["scores"] == {"EarlyStopping": STOCK_SCORES["EarlyStopping"], "ModelCheckpoint": {
            **STOCK_SCORES["ModelCheckpoint"], "best_k_models": {"step=2.ckpt": 10.0, "step=3.ckpt": 20.0}}}, (rank,
                                                                                                                 res)


def trainer_args(how):
    if how == "plugin":
        return {"plugins": [DistCheckpointIO()]}
    return {"strategy": DistCheckpointStrategy()} if how == "strategy" else {}


@pytest.mark.parametrize("how", ["plugin", "strategy"])
def test_a_file_inside_one_of_our_checkpoints_names_the_checkpoint(tmp_path, isolated_process_group, how):
    first = quiet_trainer(max_steps=2, limit_val_batches=0, enable_checkpointing=False, **trainer_args(how))
    first.fit(BoringModel())
    folder = tmp_path / "two.ckpt"
    first.save_checkpoint(folder)
    inner = folder / "common.pt"  # a torch.save archive: the common state alone
    trainer = quiet_trainer(max_steps=4, limit_val_batches=0, enable_checkpointing=False, **trainer_args(how))
    # before: KeyError: 'state_dict' (plugin), MissingKeysError "Unexpected keys ... state_dict/layer.bias" (strategy)
    with pytest.raises(FormatError, match=rf"common\.pt is a file of the checkpoint {folder} .*: pass that directory"):
        trainer.fit(BoringModel(), ckpt_path=inner)
    with pytest.raises(FormatError, match="pass that directory"):
        quiet_trainer(**trainer_args(how)).validate(BoringModel(), ckpt_path=inner, verbose=False)
    with pytest.raises(FormatError, match="pass that directory"):
        DistCheckpointIO().load_checkpoint(inner)
    trainer.fit(BoringModel(), ckpt_path=folder)  # the directory itself resumes
    assert trainer.global_step == 4


@pytest.mark.parametrize("how", ["stock", "plugin", "strategy"])
def test_what_the_user_put_under_a_checkpoints_name_stays(tmp_path, isolated_process_group, how):
    """Without the version counter, stock overwrites a ``.ckpt`` file and its top-k removal deletes a
    directory of the same names; ours refuses the save and keeps both (found sound, kept here)."""
    torch.save({"mine": 1}, tmp_path / "epoch=0-step=1.ckpt")
    (tmp_path / "epoch=0-step=2.ckpt").mkdir()
    (tmp_path / "epoch=0-step=2.ckpt" / "notes.txt").write_text("mine")
    mc = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, enable_version_counter=False)
    trainer = quiet_trainer(max_steps=3, limit_val_batches=0, callbacks=[mc], **trainer_args(how))
    if how == "stock":
        trainer.fit(BoringModel())
        assert sorted(os.listdir(tmp_path)) == ["epoch=0-step=3.ckpt"]  # the user's file and folder are gone
        return
    with pytest.raises(CheckpointingError, match=r"epoch=0-step=1\.ckpt: exists and is not a directory"):
        trainer.fit(BoringModel())
    assert torch.load(tmp_path / "epoch=0-step=1.ckpt") == {"mine": 1}
    assert (tmp_path / "epoch=0-step=2.ckpt" / "notes.txt").read_text() == "mine"


def test_last_on_s3_counts_the_version_counters_last_checkpoints(tmp_path, monkeypatch, isolated_process_group):
    moto_server = pytest.importorskip("moto.server")
    boto3 = pytest.importorskip("boto3")
    s3fs = pytest.importorskip("s3fs")
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        for name, value in (("AWS_ENDPOINT_URL", f"http://{host}:{port}"), ("AWS_ACCESS_KEY_ID", "testing"),
                            ("AWS_SECRET_ACCESS_KEY", "testing"), ("AWS_REGION", "us-east-1")):
            monkeypatch.setenv(name, value)
        s3fs.S3FileSystem.clear_instance_cache()  # none made for another server
        s3 = boto3.client("s3", endpoint_url=f"http://{host}:{port}")
        s3.create_bucket(Bucket="model-checkpoint-redteam")
        found = {}
        for where in ("s3://model-checkpoint-redteam/ckpts", str(tmp_path / "local")):
            callback = DistModelCheckpoint if where.startswith("s3://") else ModelCheckpoint  # local: Lightning's own
            for steps, every in ((2, 1), (3, 3)):  # the second run's callback differs: its last is last-v1.ckpt
                quiet_trainer(max_steps=steps, limit_val_batches=0, plugins=[DistCheckpointIO()], callbacks=[
                    callback(dirpath=where, save_last=True, every_n_train_steps=every)]).fit(BoringModel())
            resumed = quiet_trainer(max_steps=4, limit_val_batches=0, plugins=[DistCheckpointIO()],
                                    callbacks=[callback(dirpath=where, save_last=True, every_n_train_steps=3)])
            resumed.fit(BoringModel(), ckpt_path="last")
            found[where] = str(resumed.ckpt_path)
        assert found[str(tmp_path / "local")] == str(tmp_path / "local" / "last-v1.ckpt")  # stock's choice: the newer
        # before: s3://model-checkpoint-redteam/ckpts/last.ckpt/COMMITTED, the older one (step 2)
        assert found["s3://model-checkpoint-redteam/ckpts"] == "s3://model-checkpoint-redteam/ckpts/last-v1.ckpt/COMMITTED"
    finally:
        server.stop()
