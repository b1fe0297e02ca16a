"""The first hour of a user with a bucket: the usual mistakes, each through ``ldc.save`` / ``ldc.load`` or the
command line, answered with one line that says what is wrong, where (the ``s3://`` URL, the endpoint) and what
to set, in our words before any quoted curl or server text.

* A bucket that does not exist: the endpoint and AWS_ENDPOINT_URL named.
* An endpoint that is down (a closed port), one that speaks plain http asked over https, one that is no S3
  server (a web server answering 404 or 200 HTML): said so, with the setting to fix; curl's words after ours.
* Wrong credentials (an unknown access key, a bad signature) and a wrong region (S3's
  AuthorizationHeaderMalformed): said as such, with the variables to check (a stub S3 answering as AWS does).
* A typo'd prefix, a ``ModelCheckpoint`` directory given for a checkpoint, an object given for one: what is
  there instead (nothing, the checkpoints below it, a file).
* Denied or broken reads and writes of the arrays' own objects (tensorstore's requests, not ours): our words
  and the object's URL with the byte range, never curl's text alone.
"""

import contextlib
import socket
import subprocess
import sys

import pytest

import lightning_distckpt as ldc
from lightning_distckpt.core.errors import CheckpointingError, IncompleteCheckpointError
from http_stub import answering, s3_error
from relay import LEAKS, Relay
from s3_helpers import client, state, template

_ENDPOINT_HINT = "AWS_ENDPOINT_URL or StorageOptions(s3_endpoint)"


def _error(call):
    with pytest.raises(CheckpointingError) as info:
        call()
    text = str(info.value)
    assert "\n" not in text and not any(leak in text for leak in LEAKS), text
    return text


def _before(text, ours, theirs):
    """``ours`` is said, and before ``theirs`` (quoted curl or server text) when that is there."""
    assert ours in text, text
    if theirs in text:
        assert text.index(ours) < text.index(theirs), text


def _cli(*args):
    done = subprocess.run([sys.executable, "-m", "lightning_distckpt", *args], capture_output=True, text=True,
                          timeout=300)
    return done.returncode, done.stderr.strip().splitlines()[-1]


def test_missing_bucket_names_the_endpoint_and_the_setting(bucket, endpoint):
    url = "s3://no-such-bucket-first-hour/ck"
    for call in (lambda: ldc.save(state(1), url), lambda: ldc.load(template(), url)):
        text = _error(call)
        assert url in text and f"the bucket does not exist at the endpoint {endpoint}" in text, text
        assert _ENDPOINT_HINT in text, text


def test_closed_port_says_unreachable_before_curl(bucket, monkeypatch):
    with socket.socket() as s:  # a port nothing listens on: bound, never listened
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
        monkeypatch.setenv("AWS_ENDPOINT_URL", closed)
        url = f"s3://{bucket}/ck"
        for call in (lambda: ldc.save(state(1), url), lambda: ldc.load(template(), url)):
            text = _error(call)
            assert url in text and f"the endpoint {closed} is unreachable: is its server running" in text, text
            _before(text, _ENDPOINT_HINT, "Could not connect")


def test_https_to_a_plain_http_server_says_tls(bucket, endpoint, monkeypatch):
    https = endpoint.replace("http://", "https://")
    monkeypatch.setenv("AWS_ENDPOINT_URL", https)
    text = _error(lambda: ldc.load(template(), f"s3://{bucket}/ck"))
    assert f"the endpoint {https} failed the TLS handshake" in text and "plain http" in text, text
    _before(text, _ENDPOINT_HINT, "SSL")


@pytest.mark.parametrize("status,body", [(404, b"<html><body>Not Found</body></html>"),
                                         (200, b"<html><body>Welcome</body></html>")])
def test_endpoint_that_is_no_s3_server(bucket, monkeypatch, status, body):
    with answering(status, "text/html", body) as web:
        monkeypatch.setenv("AWS_ENDPOINT_URL", web)
        url = f"s3://{bucket}/ck"
        for call in (lambda: ldc.save(state(1), url), lambda: ldc.load(template(), url)):
            text = _error(call)
            assert url in text and f"the endpoint {web} does not answer as an S3 server" in text, text
            assert _ENDPOINT_HINT in text and "NOT_FOUND: Unknown" not in text and "JSON" not in text, text


@pytest.mark.parametrize("code,message,words", [
    ("InvalidAccessKeyId", "The AWS Access Key Id you provided does not exist in our records.",
     "knows no such access key (check the AWS credentials: AWS_ACCESS_KEY_ID"),
    ("SignatureDoesNotMatch", "The request signature we calculated does not match the signature you provided.",
     "refused the request's signature (check the AWS credentials: the secret key of AWS_ACCESS_KEY_ID"),
])
def test_wrong_credentials(bucket, monkeypatch, code, message, words):
    with answering(403, "application/xml", s3_error(code, message)) as s3:
        monkeypatch.setenv("AWS_ENDPOINT_URL", s3)
        text = _error(lambda: ldc.load(template(), f"s3://{bucket}/ck"))
        assert f"s3://{bucket}/ck" in text and f"access denied: the endpoint {s3} {words}" in text, text


def test_wrong_region(bucket, monkeypatch):
    body = s3_error("AuthorizationHeaderMalformed", "The authorization header is malformed; the region "
                     "'us-east-1' is wrong; expecting 'eu-west-1'")
    with answering(400, "application/xml", body) as s3:
        monkeypatch.setenv("AWS_ENDPOINT_URL", s3)
        for call in (lambda: ldc.save(state(1), f"s3://{bucket}/ck"), lambda: ldc.load(template(), f"s3://{bucket}/ck")):
            text = _error(call)
            assert "the bucket is not in the region us-east-1 but in eu-west-1: set AWS_REGION or " \
                   "StorageOptions(s3_region)" in text, text


def test_what_is_there_instead_of_a_checkpoint(bucket, endpoint):
    ldc.save(state(1), f"s3://{bucket}/runs/step-1")
    ldc.save(state(2), f"s3://{bucket}/runs/step-2")
    client(endpoint).put_object(Bucket=bucket, Key="model.pt", Body=b"not a checkpoint")
    for url, words in ((f"s3://{bucket}/run/step-1", "nothing is stored under it: check the bucket and the prefix"),
                       (f"s3://{bucket}/runs", f"it holds 2 checkpoint(s) below it, give one of them: "
                                               f"s3://{bucket}/runs/step-1, s3://{bucket}/runs/step-2"),
                       (f"s3://{bucket}/model.pt", f"s3://{bucket}/model.pt is an object (a file), not a checkpoint")):
        with pytest.raises(IncompleteCheckpointError) as info:
            ldc.load(template(), url)
        assert f"{url}: no commit marker (COMMITTED): {words}" in str(info.value), str(info.value)
    status, line = _cli("inspect", f"s3://{bucket}/runs")
    assert status == 2 and f"s3://{bucket}/runs/step-1, s3://{bucket}/runs/step-2" in line, line
    status, line = _cli("validate", f"s3://{bucket}/model.pt")
    assert status == 2 and "is an object (a file), not a checkpoint" in line, line


class _Cut(Relay):
    """A relay that closes the connection of a request ``deny`` picks, unanswered (curl: Empty reply)."""

    def _seen(self, line, src):
        method, path = line.group(1).decode(), line.group(2).decode()
        self.requests.append((method, path))
        if self.deny(method, path.split("?")[0]):
            self.denied.append((method, path))
            with contextlib.suppress(OSError):
                src.shutdown(socket.SHUT_RDWR)
            return True
        return False


def _array_object(method, path):
    return "/data/rank_00000/d/" in path and method in ("GET", "PUT")


@pytest.mark.parametrize("relay,words", [(Relay, "access denied (check the AWS credentials and what they may do"),
                                         (_Cut, "broke off its answer (")])
def test_array_reads_and_writes_said_in_our_words(bucket, endpoint, monkeypatch, relay, words):
    url = f"s3://{bucket}/ck"
    ldc.save(state(1), url)
    proxy = relay.to(endpoint, deny=_array_object)
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        text = _error(lambda: ldc.load(template(), url))
        _before(text, words, "CURL error")
        assert "ABORTED" not in text and "PERMISSION_DENIED" not in text and "All 4 retry" not in text, text
        assert ", reading bytes [" in text and f"of {url}/v-" in text and "/data/rank_00000/d/" in text, text
        text = _error(lambda: ldc.save(state(2), url))
        assert words in text and "ABORTED" not in text and "PERMISSION_DENIED" not in text, text
        assert proxy.denied, proxy.requests
    finally:
        proxy.close()
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    ldc.load(template(), url)  # the first save still loads
