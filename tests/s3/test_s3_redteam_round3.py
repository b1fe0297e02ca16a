"""``s3://`` checkpoints, third red-team pass (moto's S3 server on loopback, this folder's fixtures), with
a byte-counting TCP relay between tensorstore and the server to measure what a reader fetches: a writer's
object far larger than its cap, an object replaced by a larger one between its size probe and its read,
``inspect`` / ``validate`` fetching ``common.pt`` for its size, server error bodies (XML) in our errors,
and two saves naming one version."""

import contextlib
import io
import json
import time

import pytest

import lightning_distckpt as ldc
from lightning_distckpt.cli.main import main
from lightning_distckpt.core.errors import CheckpointingError, FormatError, SaveFailedError
from lightning_distckpt.storage import s3 as s3_mod

pytest.importorskip("moto.server")
from relay import Relay  # noqa: E402
from s3_helpers import check, client, keys, marker, state, template  # noqa: E402

MiB = 1 << 20


@pytest.fixture
def relay(endpoint, bucket, monkeypatch):
    """A relay to the moto server; every S3 request of this process goes through it."""
    r = Relay.to(endpoint)
    monkeypatch.setenv("AWS_ENDPOINT_URL", r.url)
    yield r
    r.close()


def _quiet(argv):
    with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.redirect_stderr(io.StringIO()) as err:
        code = main(argv)
    return code, out.getvalue() + err.getvalue()


def _version_key(endpoint, bucket, prefix, suffix):
    version = marker(endpoint, bucket, prefix)["version"]
    return next(k for k in keys(endpoint, bucket) if k.startswith(f"{prefix}/{version}/") and k.endswith(suffix))


def test_a_writer_object_far_larger_than_its_cap_is_refused_before_it_is_fetched(bucket, endpoint, relay):
    """An OCDBT ``manifest.ocdbt`` (which tensorstore reads whole; a directory's is capped at 64 MiB,
    ``check_writer``) replaced by 65 MiB: the load fetched all 65 MiB before tensorstore failed to
    parse it (S3 had no ``check_writer``). Now refused, naming the object, after a listing and one byte."""
    url = f"s3://{bucket}/ck"
    ldc.save(state(1), url)
    manifest = _version_key(endpoint, bucket, "ck", "/data/rank_00000/manifest.ocdbt")
    client(endpoint).put_object(Bucket=bucket, Key=manifest, Body=bytes(65 * MiB))
    relay.served = 0
    with pytest.raises(CheckpointingError) as raised:
        ldc.load(template(), url)
    assert relay.served < 2 * MiB, relay.served
    assert isinstance(raised.value, FormatError) and "manifest.ocdbt holds more than the 67108864 bytes" in str(
        raised.value), raised.value


def test_an_object_replaced_by_a_larger_one_after_its_size_probe_is_read_no_further(bucket, endpoint, relay):
    """``COMMITTED`` (capped at 1 MiB) replaced by an 8 MiB object between the size probe and the read:
    the read fetched all 8 MiB (the probe was trusted). Now every read of it is a byte range of at
    most the cap: at most ~1 MiB fetched, and the load refused."""
    url = f"s3://{bucket}/ck"
    ldc.save(state(1), url)
    big = b" " * (8 * MiB) + json.dumps(marker(endpoint, bucket, "ck")).encode()
    gets = []

    def swap_after_the_first_read(method, path):
        if method == "GET" and path.split("?")[0] == f"/{bucket}/ck/COMMITTED":
            gets.append(path)
            if len(gets) == 2:  # the server answers this request only after the swap
                client(endpoint).put_object(Bucket=bucket, Key="ck/COMMITTED", Body=big)

    relay.on_request = swap_after_the_first_read
    relay.served = 0
    with pytest.raises(CheckpointingError):
        ldc.load(template(), url)
    assert len(gets) >= 2 and relay.served < 3 * MiB, (gets, relay.served)


def test_inspect_and_validate_do_not_fetch_common_state_for_its_size(bucket, endpoint, relay):
    """``inspect`` read all of ``common.pt`` to show its size, ``validate`` read it twice (once for
    that size, once to check its SHA-256). Now its size comes from ranged reads of a few hundred KiB."""
    url = f"s3://{bucket}/ck"
    sd = state(1)
    sd["blob"] = bytes(range(256)) * (32 * 1024)  # 8 MiB of common state
    ldc.save(sd, url)
    common = client(endpoint).head_object(Bucket=bucket, Key=_version_key(endpoint, bucket, "ck", "/common.pt"))
    size = common["ContentLength"]
    relay.served = 0
    code, out = _quiet(["inspect", url, "--json"])
    assert code == 0, out
    assert json.loads(out)["common_bytes"] == size
    assert relay.served < 3 * MiB, relay.served
    relay.served = 0
    code, out = _quiet(["validate", url])
    assert code == 0, out
    assert relay.served < size + 3 * MiB, (relay.served, size)


def test_a_server_error_is_said_in_words_without_its_xml_body(bucket, endpoint):
    """A data object cut short: the load's error and ``validate``'s report quoted the server's XML
    answer (``[http_response_body='<?xml ...<Error>...']``: on a bad signature, S3's holds the access
    key's id, the string signed and the canonical request) and request-id headers. Now: tensorstore's
    words and the HTTP status."""
    url = f"s3://{bucket}/ck"
    ldc.save(state(1), url)
    data = next(k for k in keys(endpoint, bucket) if "/data/rank_00000/d/" in k)
    body = client(endpoint).get_object(Bucket=bucket, Key=data)["Body"].read()
    client(endpoint).put_object(Bucket=bucket, Key=data, Body=body[:10])
    with pytest.raises(CheckpointingError) as raised:
        ldc.load(template(), url)
    code, out = _quiet(["validate", url])
    assert code == 1, out
    for text in (str(raised.value), out):
        assert "not satisfiable (HTTP 416)" in text, text
        for leak in ("<?xml", "<Error>", "http_response_body", "x-amzn", "RequestId", "ActualObjectSize"):
            assert leak not in text, text
        assert max(len(line) for line in text.splitlines()) < 600, text


def test_two_saves_naming_one_version_never_share_it(bucket, endpoint, monkeypatch):
    """Save A commits version ``v-<second><4 hex>``; save B to the same name draws the same name (once
    in 65,536 in one second) and wrote into A's committed version; when B then failed, its discard
    deleted A's objects: A, still the committed checkpoint, no longer loaded. Now a version holding
    anything is never taken, and B writes elsewhere."""
    url = f"s3://{bucket}/ck"
    now, drawn = int(time.time()), []

    class SameSecond:  # the clock and the random digits of two saves that collide
        @staticmethod
        def time():
            return float(now)

    class SameDigits:
        @staticmethod
        def token_hex(n):
            drawn.append(n)
            return "abcd" if n == 2 and drawn.count(2) <= 2 else __import__("secrets").token_hex(n)

    monkeypatch.setattr(s3_mod, "time", SameSecond)
    monkeypatch.setattr(s3_mod, "secrets", SameDigits)
    ldc.save(state(1), url)
    first = marker(endpoint, bucket, "ck")["version"]
    assert first == f"v-{now:08x}abcd"

    def fail(version_url, name, data, options):  # B fails after its shards are written
        raise OSError("network down")

    monkeypatch.setattr(s3_mod, "write_object", fail)
    with pytest.raises(SaveFailedError):  # "network down" (before: also "ALREADY_EXISTS", A's store in the way)
        ldc.save(state(2), url)
    assert drawn.count(2) >= 2  # B drew A's name first
    assert marker(endpoint, bucket, "ck")["version"] == first
    check(ldc.load(template(), url), 1)
    assert not [k for k in keys(endpoint, bucket) if k.startswith("ck/v-") and not k.startswith(f"ck/{first}/")]
