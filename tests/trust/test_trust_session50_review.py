"""A reviewer's hunt in this session's changes (helper-70): what a real run showed wrong, kept fixed.

- An S3 403 whose error document names a cause other than denied access (a clock too far off the server's,
  RequestTimeTooSkewed; an archived object, InvalidObjectState) was worded "access denied ... check the AWS
  credentials": the new status-only branch (meant for a HEAD's answer, which has no document) and the
  PERMISSION_DENIED test took every 403. The server's own code and message are said instead.
- A Megatron-Core strategy subclassed outside megatron-core (NeMo's async TorchDist strategy subclasses
  TorchDistSaveShardedStrategy) was refused by save/load as "not a Megatron-Core strategy".
"""

import contextlib

import pytest
import torch

import lightning_distckpt as ldc
from lightning_distckpt.core.errors import CheckpointingError
from http_stub import answering, s3_error


@contextlib.contextmanager
def _s3_refusing(status, code, message):
    with answering(status, "application/xml", s3_error(code, message)) as endpoint:
        yield endpoint


def _template():
    return {"w": ldc.ShardedTensor.from_rank_offsets("w", torch.zeros(4))}


@pytest.mark.parametrize("code,message", [
    ("RequestTimeTooSkewed", "The difference between the request time and the current time is too large."),
    ("InvalidObjectState", "The operation is not valid for the object storage class"),
])
def test_s3_403_with_another_cause_is_not_said_as_denied_access(monkeypatch, code, message):
    pytest.importorskip("tensorstore")
    with _s3_refusing(403, code, message) as endpoint:
        for name, value in (("AWS_ENDPOINT_URL", endpoint), ("AWS_ACCESS_KEY_ID", "testing"),
                            ("AWS_SECRET_ACCESS_KEY", "testing"), ("AWS_REGION", "us-east-1")):
            monkeypatch.setenv(name, value)
        with pytest.raises(CheckpointingError) as info:  # one attempt: tensorstore retries a 403 it takes as transient
            ldc.load(_template(), "s3://some-bucket/ck", storage=ldc.StorageOptions(s3_retries=1))
    text = str(info.value)
    assert "s3://some-bucket/ck" in text and f"{code}: {message}" in text, text
    assert "access denied" not in text and "check the AWS credentials" not in text, text


def test_s3_403_access_denied_document_still_said_as_denied(monkeypatch):
    pytest.importorskip("tensorstore")
    with _s3_refusing(403, "AccessDenied", "Access Denied") as endpoint:
        for name, value in (("AWS_ENDPOINT_URL", endpoint), ("AWS_ACCESS_KEY_ID", "testing"),
                            ("AWS_SECRET_ACCESS_KEY", "testing"), ("AWS_REGION", "us-east-1")):
            monkeypatch.setenv(name, value)
        with pytest.raises(CheckpointingError) as info:
            ldc.load(_template(), "s3://some-bucket/ck")
    assert "access denied (check the AWS credentials" in str(info.value), str(info.value)


def test_megatron_strategy_subclassed_outside_megatron_core_is_taken(tmp_path):
    strategies = pytest.importorskip("megatron.core.dist_checkpointing.strategies.torch")

    class FrameworkSave(strategies.TorchDistSaveShardedStrategy):  # as NeMo's async TorchDist strategy is
        pass

    class FrameworkLoad(strategies.TorchDistLoadShardedStrategy):
        pass

    data = torch.arange(4.0)
    ldc.save({"w": ldc.ShardedTensor.from_rank_offsets("w", data)}, str(tmp_path / "ck"),
             FrameworkSave("torch_dist", 1))
    out = ldc.load(_template(), str(tmp_path / "ck"), FrameworkLoad())
    assert torch.equal(out["w"], data)
