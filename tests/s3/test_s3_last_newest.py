"""``ckpt_path="last"`` with several last checkpoints in an S3 folder (``last.ckpt`` and the version
counter's ``last-v1.ckpt``): Lightning compares the modification times of what
``DistModelCheckpoint`` lists, whole seconds on S3, so two commits within one second tied and either was
resumed. The callback now lists only the newest by its marker's ``committed_unix``. Real saves to moto's
S3 server; the markers' times are set apart in the checkpoints themselves, not by waiting."""

import json

import torch

import lightning_distckpt as ldc
from lightning_distckpt.lightning.model_checkpoint import DistModelCheckpoint
from s3_helpers import client


def _save(url: str, value: float) -> None:
    ldc.save({"w": ldc.ShardedTensor.from_rank_offsets("w", torch.full((4,), value))}, url)


def _set_commit_time(endpoint: str, bucket: str, name: str, when: float) -> None:
    """The marker's committed_unix (the commit's own clock reading) moved: the order is the test's, not the clock's."""
    s3 = client(endpoint)
    key = f"ckpts/{name}/COMMITTED"
    marker = json.loads(s3.get_object(Bucket=bucket, Key=key)["Body"].read())
    marker["committed_unix"] = when
    s3.put_object(Bucket=bucket, Key=key, Body=json.dumps(marker).encode())


def test_the_newest_last_checkpoint_is_the_one_listed(endpoint, bucket):
    folder = f"s3://{bucket}/ckpts"
    _save(f"{folder}/last.ckpt", 1.0)
    _save(f"{folder}/last-v1.ckpt", 2.0)
    _save(f"{folder}/epoch=0-step=1.ckpt", 3.0)  # not a last checkpoint
    callback = DistModelCheckpoint(dirpath=folder, save_last=True)
    for newest, older in (("last-v1.ckpt", "last.ckpt"), ("last.ckpt", "last-v1.ckpt")):
        _set_commit_time(endpoint, bucket, older, 1_000_000.25)
        _set_commit_time(endpoint, bucket, newest, 1_000_000.75)  # the same second
        assert callback._find_last_checkpoints(None) == {f"{folder}/{newest}/COMMITTED"}


def test_a_marker_that_cannot_say_leaves_the_choice_to_lightning(endpoint, bucket):
    folder = f"s3://{bucket}/ckpts"
    _save(f"{folder}/last.ckpt", 1.0)
    _save(f"{folder}/last-v1.ckpt", 2.0)
    _set_commit_time(endpoint, bucket, "last.ckpt", float("nan"))  # json writes NaN; not a time
    assert DistModelCheckpoint(dirpath=folder)._find_last_checkpoints(None) == {
        f"{folder}/last.ckpt/COMMITTED", f"{folder}/last-v1.ckpt/COMMITTED"}
