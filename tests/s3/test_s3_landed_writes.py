"""``s3://`` saves whose writes the server carried out but answered as failed (a 500 or a 503 after the object
was stored, as S3 now and then does): tensorstore retries them, and an OCDBT manifest's retry, taken for a
conflict with another writer, applies the save's transaction again on top of its own landed commit. Expected:
the save commits and loads bit-exact; a failure on every attempt is a clean, bounded SaveFailedError with
nothing committed and the previous checkpoint intact. The proxy is ``test_s3_hostile_server.py``'s."""

from __future__ import annotations

from typing import Dict, Optional

import pytest
import torch

import lightning_distckpt as ldc
from lightning_distckpt.core.errors import SaveFailedError
from dist_utils import run_distributed
from trust.hostile import run_bounded

pytest.importorskip("moto.server")
from s3_helpers import check, client, keys, state, template  # noqa: E402
import test_s3_hostile_server as hostile  # noqa: E402

Answer = hostile.Answer
proxied = hostile.proxied  # the fixture: a proxy in front of moto that every S3 request goes through

_SAFETY_S = 120  # only a net under a hang (a retry loop that never ends)
_ANSWERS = {"500": (500, b"<Error><Code>InternalError</Code><Message>We encountered an internal error.</Message>"
                         b"</Error>"),
            "503": (503, b"<Error><Code>SlowDown</Code><Message>Reduce your request rate.</Message></Error>")}


def _landed_then_failed(what: str, status: str, times: Optional[int] = 1):
    """A proxy rule: the first ``times`` PUTs whose path holds ``what`` are passed on to moto (stored) and then
    answered with ``status`` (every one when ``times`` is None); ``hits`` counts those PUTs."""
    hits: Dict[str, int] = {"n": 0}

    def rule(method: str, path: str, ans: Answer) -> None:
        if method == "PUT" and what in path and ans.status == 200:
            hits["n"] += 1
            if times is None or hits["n"] <= times:
                ans.status, body = _ANSWERS[status]
                ans.headers, ans.body = [("Content-Type", "application/xml")], body
    return rule, hits


@pytest.mark.parametrize("status", ["500", "503"])
def test_a_manifest_put_that_landed_but_failed_is_retried_and_loads(bucket, proxied, status):
    """The first PUT of a rank store's ``manifest.ocdbt`` stored, then answered 500 / 503: the save commits
    (it failed ALREADY_EXISTS on the zarr.json of its own first attempt) and loads bit-exact."""
    rule, hits = _landed_then_failed("/manifest.ocdbt", status)
    proxied(rule=rule)
    url = f"s3://{bucket}/ck"
    got = run_bounded(lambda: ldc.save(state(4), url), _SAFETY_S)
    assert "error" not in got, got
    assert hits["n"] == 1  # the landed commit read back and taken, not written again
    check(ldc.load(template(), url), 4)


@pytest.mark.parametrize("times", [1, None])
def test_a_zarr_json_put_that_landed_but_failed_is_retried_and_loads(bucket, proxied, times):
    """The zarr layout: an array's ``zarr.json`` PUT (written only if absent) stored, then answered 500, once or
    every time: its retry fails ALREADY_EXISTS against itself; the store reads back whole, the save commits and
    loads bit-exact."""
    rule, hits = _landed_then_failed("/zarr.json", "500", times)
    proxied(rule=rule)
    url = f"s3://{bucket}/ck"
    got = run_bounded(lambda: ldc.save(state(4), url, storage=ldc.StorageOptions(layout="zarr")), _SAFETY_S)
    assert "error" not in got, got
    assert hits["n"] >= 1
    check(ldc.load(template(), url), 4)


def test_a_data_object_put_that_landed_but_failed_is_retried_and_loads(bucket, proxied):
    """The first PUT of an OCDBT data object (``d/...``, written unconditionally) stored, then answered 500:
    sent again, the save commits and loads bit-exact."""
    rule, hits = _landed_then_failed("/d/", "500")
    proxied(rule=rule)
    url = f"s3://{bucket}/ck"
    ldc.save(state(5), url)
    assert hits["n"] >= 2
    check(ldc.load(template(), url), 5)


def _save_rank(rank: int, world: int, url: str) -> None:
    ldc.save(state(6, rank, world), url)


def _load_rank(rank: int, world: int, url: str) -> bool:
    check(ldc.load(template(rank, world), url), 6, rank, world)
    return True


def test_a_landed_manifest_put_of_one_rank_of_two_is_retried(bucket, proxied):
    """Two ranks (gloo), rank 1's store manifest PUT stored and answered 500 once: both ranks' save returns,
    and a 2-rank load (another split) is bit-exact."""
    rule, hits = _landed_then_failed("/rank_00001/manifest.ocdbt", "500")
    proxied(rule=rule)
    url = f"s3://{bucket}/ck"
    run_distributed(_save_rank, 2, url)
    assert hits["n"] == 1
    assert run_distributed(_load_rank, 2, url) == [True, True]


def test_an_async_save_in_waves_retries_a_landed_manifest_put_of_its_second_wave(bucket, proxied):
    """An async save under a staging budget writes one store in two calls (two commits); the second call's
    manifest PUT stored, then answered 500: its retry applies that call again on top of the first call's
    commit and its own landed one, and every array of both calls loads bit-exact."""
    puts = {"n": 0}

    def second(method: str, path: str, ans: Answer) -> None:
        if method == "PUT" and path.endswith("/manifest.ocdbt") and ans.status == 200:
            puts["n"] += 1
            if puts["n"] == 2:  # the second call's first commit attempt
                ans.status, ans.body = _ANSWERS["500"]

    proxied(rule=second)
    url = f"s3://{bucket}/ck"
    sd = {f"w{i}": ldc.ShardedTensor.from_rank_offsets(f"w{i}", torch.full((1000,), float(i))) for i in range(3)}
    saver = ldc.AsyncSaver(max_staging_bytes=5_000, writer_bytes=0)
    request = saver.save(sd, url, storage=ldc.StorageOptions(pack_max_bytes=0))
    request.finalize()
    assert request.waves == 2 and puts["n"] == 2
    out = ldc.load({k: ldc.ShardedTensor.from_rank_offsets(k, torch.empty(1000)) for k in sd}, url)
    assert all(torch.equal(out[f"w{i}"], torch.full((1000,), float(i))) for i in range(3))


def test_a_manifest_put_that_always_lands_but_fails_is_taken_once_read_back(bucket, proxied):
    """Every manifest PUT stored and answered 500: no endless retry (tensorstore's conflict loop ends at its
    second round, ALREADY_EXISTS); everything the commit wrote reads back as written, so the save commits
    and loads bit-exact."""
    rule, hits = _landed_then_failed("/manifest.ocdbt", "500", times=None)
    proxied(rule=rule)
    url = f"s3://{bucket}/ck"
    got = run_bounded(lambda: ldc.save(state(8), url), _SAFETY_S)
    assert "error" not in got, got
    assert hits["n"] >= 1
    check(ldc.load(template(), url), 8)


def _refused(what: str, status: str, store=None):
    """A ``refuse`` hook: every PUT whose path holds ``what`` answered ``status`` without passing it on, after
    ``store(path)`` (if given) put something of its own there."""
    def refuse(method: str, path: str) -> Optional[Answer]:
        if method != "PUT" or what not in path:
            return None
        if store is not None:
            store(path)
        code, body = _ANSWERS[status]
        return Answer(code, [("Content-Type", "application/xml")], body)
    return refuse


def _check_nothing_committed(got: dict, url: str, endpoint: str, bucket: str, before: list) -> None:
    assert isinstance(got.get("error"), SaveFailedError), got
    text = str(got["error"])
    assert url in text and "nothing was committed" in text and "\n" not in text, text
    assert keys(endpoint, bucket) == before  # its version removed, the previous one untouched
    check(ldc.load(template(), url), 1)


def test_a_manifest_put_refused_every_time_commits_nothing(bucket, endpoint, proxied):
    """Every manifest PUT answered 500 and not stored: retried, then one SaveFailedError naming the
    checkpoint, nothing committed, the previous checkpoint loading."""
    url = f"s3://{bucket}/ck"
    ldc.save(state(1), url)
    before = keys(endpoint, bucket)
    proxied(refuse=_refused("/manifest.ocdbt", "500"))
    _check_nothing_committed(run_bounded(lambda: ldc.save(state(2), url), _SAFETY_S), url, endpoint, bucket,
                             before)


def test_another_saves_manifest_where_ours_failed_is_never_taken(bucket, endpoint, proxied):
    """The manifest PUT answered 500, and what is there instead is another save's manifest (of the same
    state's shapes): never taken for this save's commit, the save fails cleanly, nothing committed."""
    url = f"s3://{bucket}/ck"
    ldc.save(state(1), url)
    before = keys(endpoint, bucket)
    other = next(k for k in before if k.endswith("/data/rank_00000/manifest.ocdbt"))
    foreign = client(endpoint).get_object(Bucket=bucket, Key=other)["Body"].read()

    def plant(path: str) -> None:
        client(endpoint).put_object(Bucket=bucket, Key=path.split("?")[0].split("/", 2)[2], Body=foreign)

    proxied(refuse=_refused("/manifest.ocdbt", "500", store=plant))
    got = run_bounded(lambda: ldc.save(state(2), url), _SAFETY_S)
    _check_nothing_committed(got, url, endpoint, bucket, before)
