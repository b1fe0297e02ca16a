"""``s3://`` checkpoints against hostile or broken servers and bucket contents (moto's S3 server on
loopback, this folder's fixtures, and a silent server: a loopback socket that accepts connections and
never answers): every operation fails within a bound with one line naming the endpoint or object,
and nothing that is not ours is deleted or taken for a checkpoint."""

import socket
import threading
import time

import pytest

import lightning_distckpt as ldc
from lightning_distckpt.cli.main import main
from lightning_distckpt.core.errors import CheckpointingError
from dist_utils import run_distributed
from trust.hostile import run_bounded

pytest.importorskip("moto.server")
from s3_helpers import client, keys, save_and_load_errors, template  # noqa: E402

_SAFETY_S = 120  # only a net under a hang: the bound asserted is the error itself


@pytest.fixture
def silent_endpoint(monkeypatch):
    """``http://127.0.0.1:PORT`` of a server that accepts every connection and never sends a byte
    (the AWS environment points at it, with a small answer bound)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    held = []

    def accept():
        while True:
            try:
                held.append(server.accept()[0])
            except OSError:  # closed: the test is over
                return

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.getsockname()[1]}"
    for name, value in (("AWS_ENDPOINT_URL", url), ("AWS_ACCESS_KEY_ID", "testing"),
                        ("AWS_SECRET_ACCESS_KEY", "testing"), ("AWS_REGION", "us-east-1"),
                        ("LIGHTNING_DISTCKPT_S3_TIMEOUT", "0.5")):
        monkeypatch.setenv(name, value)
    yield url
    server.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept (a close alone does not, on Linux)
    thread.join(_SAFETY_S)
    server.close()
    for conn in held:
        conn.close()


def _one_line(text, url, endpoint):
    assert url in text and f"the endpoint {endpoint} did not answer within 0.5 s" in text, text
    assert "LIGHTNING_DISTCKPT_S3_TIMEOUT" in text and "\n" not in text, text


def test_a_silent_endpoint_fails_save_and_load_on_every_rank_within_the_bound(silent_endpoint):
    """A server that accepts and never answers held each request for curl's stall limit (60 s) on
    every attempt: about 5 minutes per save or load before an error."""
    url = "s3://bucket/ck"
    got = run_bounded(lambda: run_distributed(save_and_load_errors, 2, url), _SAFETY_S)
    assert "value" in got, got
    for errors in got["value"]:
        assert len(errors) == 2, errors
        for text in errors:
            _one_line(text, url, silent_endpoint)


@pytest.mark.parametrize("command", ["inspect", "validate", "clean"])
def test_a_silent_endpoint_fails_each_command_in_one_line(silent_endpoint, capsys, command):
    url = "s3://bucket/ck"
    got = run_bounded(lambda: main([command, url]), _SAFETY_S)
    out = capsys.readouterr()
    assert got.get("value") == 2, (got, out.err)
    _one_line(out.err.strip(), url, silent_endpoint)


def test_a_silent_endpoint_fails_resolving_last_in_one_line(silent_endpoint):
    """``ckpt_path="last"`` on an ``s3://`` dirpath began with an object listing (unbounded)."""
    from lightning_distckpt.lightning import DistModelCheckpoint

    url = "s3://bucket/runs"
    got = run_bounded(lambda: DistModelCheckpoint(dirpath=url)._find_last_checkpoints(None), _SAFETY_S)
    assert isinstance(got.get("error"), CheckpointingError), got
    _one_line(str(got["error"]), url, silent_endpoint)


def test_a_bad_answer_bound_is_refused_naming_the_variable(bucket, monkeypatch):
    monkeypatch.setenv("LIGHTNING_DISTCKPT_S3_TIMEOUT", "5s")
    with pytest.raises(CheckpointingError, match="LIGHTNING_DISTCKPT_S3_TIMEOUT='5s'"):
        ldc.load(template(), f"s3://{bucket}/ck")


def test_a_key_with_a_control_character_does_not_stop_clean(bucket, endpoint, capsys):
    """A key ``root/x<TAB>y/v-.../metadata.json`` (no URL can name its location) was an ArgumentError
    for the whole tree, exit 2: one object anyone with write access put there stopped every cleaning."""
    old = f"v-{int(time.time()) - 100_000:08x}abcd"
    odd = [f"root/x\ty/{old}/metadata.json", f"root/z\x7fz/{old}/metadata.json"]
    for key in odd + [f"root/ck/{old}/metadata.json"]:
        client(endpoint).put_object(Bucket=bucket, Key=key, Body=b"{}")
    code = main(["clean", f"s3://{bucket}/root"])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert keys(endpoint, bucket) == sorted(odd), out.out  # the real leftover removed, the others left alone

