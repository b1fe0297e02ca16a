"""Lightning and Fabric on ``s3://`` checkpoints against moto's S3 server on loopback (the fixtures of
tests/s3/test_s3.py): ``DistModelCheckpoint(dirpath="s3://...")`` with top-k removal and
``ckpt_path="last"`` under the ``DistCheckpointIO`` plugin (in this process) and under
``DistCheckpointStrategy`` (2 processes, TP 2), and ``fabric.save`` / ``fabric.load`` (2 processes).
Lightning's ``ModelCheckpoint`` needs ``s3fs`` for an ``s3://`` dirpath."""

import pytest
import torch

pytest.importorskip("moto.server")
pytest.importorskip("s3fs")
from lightning.pytorch import Callback, Trainer  # noqa: E402
from lightning.pytorch.demos.boring_classes import BoringModel  # noqa: E402

from lightning_distckpt.lightning import DistCheckpointIO  # noqa: E402
from lightning_distckpt.lightning.model_checkpoint import DistModelCheckpoint  # noqa: E402
from lightning_helpers import run_script  # noqa: E402
from s3_helpers import keys as _keys  # noqa: E402


class _Model(BoringModel):
    def training_step(self, batch, batch_idx):
        out = super().training_step(batch, batch_idx)
        self.log("step_metric", float(self.global_step))  # top-k keeps the latest steps
        return out


class _FirstStep(Callback):
    """The global step and the weights the run starts from (after any restore)."""

    def on_train_start(self, trainer, module):
        self.step = trainer.global_step
        self.weights = {k: v.detach().clone() for k, v in module.state_dict().items()}


def _fit(dirpath, steps, ckpt_path=None):
    cb, first = DistModelCheckpoint(dirpath=dirpath, filename="{step}", monitor="step_metric", mode="max",
                                    save_top_k=2, every_n_train_steps=1, save_last=True), _FirstStep()
    t = Trainer(accelerator="cpu", devices=1, max_steps=steps, plugins=[DistCheckpointIO()], callbacks=[cb, first],
                logger=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)
    t.fit(_Model(), ckpt_path=ckpt_path)
    return t, first


def _checkpoints(endpoint, bucket, prefix):
    """{checkpoint name: its objects} under ``prefix``."""
    out = {}
    for key in _keys(endpoint, bucket):
        if key.startswith(prefix + "/"):
            name = key[len(prefix) + 1:].split("/", 1)[0]
            out.setdefault(name, []).append(key)
    return out


def test_plugin_top_k_on_s3_and_resume_from_last(bucket, endpoint):
    dirpath = f"s3://{bucket}/runs/ckpts"
    _fit(dirpath, 4)
    stored = _checkpoints(endpoint, bucket, "runs/ckpts")
    assert sorted(stored) == ["last.ckpt", "step=3.ckpt", "step=4.ckpt"]  # step 1 and 2 removed, every object
    assert all(f"runs/ckpts/{n}/COMMITTED" in keys for n, keys in stored.items())
    saved = DistCheckpointIO().load_checkpoint(f"{dirpath}/last.ckpt")
    assert saved["global_step"] == 4

    t, first = _fit(dirpath, 6, ckpt_path="last")
    assert t.ckpt_path == f"{dirpath}/last.ckpt/COMMITTED"  # the marker names its checkpoint
    assert first.step == 4
    assert all(torch.equal(first.weights[k], v) for k, v in saved["state_dict"].items())
    assert sorted(_checkpoints(endpoint, bucket, "runs/ckpts")) == ["last.ckpt", "step=5.ckpt", "step=6.ckpt"]


def test_without_s3_dirpath_it_is_model_checkpoint(tmp_path):
    (tmp_path / "last.ckpt").write_bytes(b"x")
    (tmp_path / "step=1.ckpt").write_bytes(b"x")
    assert DistModelCheckpoint(dirpath=tmp_path)._find_last_checkpoints(None) == {str(tmp_path / "last.ckpt")}


def test_strategy_on_two_ranks_top_k_and_last_on_s3(bucket, tmp_path):
    url = f"s3://{bucket}/run"
    for res in run_script("s3_scenarios.py", ["trainer", "--dir", url], str(tmp_path / "out"), world_size=2):
        assert res["listing"] == ["last.ckpt", "step=3.ckpt", "step=4.ckpt"], res  # train_loss falls: the latest
        assert res["best"] == ["step=3.ckpt", "step=4.ckpt"]
        assert res["resumed_from"] == f"{url}/ckpts/last.ckpt/COMMITTED" and res["first_step"] == 4
        restored = res["restored"]
        assert restored["global_step"] == 4 and all(restored["weights"].values()) and all(restored["moments"].values())
        assert restored["sched"] and restored["lr"] and restored["callback_count"] == 4
        assert res["listing_after"] == ["last.ckpt", "step=5.ckpt", "step=6.ckpt"]


def test_fabric_save_and_load_on_s3_two_ranks(bucket, endpoint, tmp_path):
    url = f"s3://{bucket}/run"
    for res in run_script("s3_scenarios.py", ["fabric", "--dir", url], str(tmp_path / "out"), world_size=2):
        assert res["loaded_step"] == 3 and res["exact"] is True and res["remainder"] == "hello"
        assert res["whole_shapes"] == {"fc1.weight": [16, 8], "fc1.bias": [16], "fc2.weight": [4, 16], "fc2.bias": [4]}
    assert sum(k.endswith("manifest.ocdbt") for k in _keys(endpoint, bucket)) == 2  # both ranks wrote


def test_remove_checkpoint_on_s3_removes_only_ours(bucket, endpoint):
    import lightning_distckpt as ldc
    from lightning_distckpt.core.errors import FormatError
    from s3_helpers import client as _client, state as _state

    url = f"s3://{bucket}/ck"
    ldc.save(_state(1), url)
    client = _client(endpoint)
    client.put_object(Bucket=bucket, Key="ck/notes.txt", Body=b"the user's")
    client.put_object(Bucket=bucket, Key="ck/v-0123456789ab/mine.txt", Body=b"not a save's name")
    DistCheckpointIO().remove_checkpoint(url)
    assert _keys(endpoint, bucket) == ["ck/notes.txt", "ck/v-0123456789ab/mine.txt"]
    DistCheckpointIO().remove_checkpoint(url)  # nothing there: nothing happens
    client.put_object(Bucket=bucket, Key="other/COMMITTED", Body=b"{}")
    with pytest.raises(FormatError, match="COMMITTED"):
        DistCheckpointIO().remove_checkpoint(f"s3://{bucket}/other")
    assert "other/COMMITTED" in _keys(endpoint, bucket)
