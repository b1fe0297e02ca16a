"""``s3://`` saves running longer than the bound of ``clean`` / a checkpoint's removal (600 s by default),
against moto's S3 server on loopback (this folder's fixtures). A listing has no modification times, so a
version's age was its save's start time: such a save had its objects deleted under it, and then failed,
or committed a version with objects missing. Now rank 0 marks its version live while the save runs
(``storage/s3_live.py``), removals date a version by its newest mark, and the commit refuses a version
whose claim or a writer's store is gone. No test waits for a duration of work: a save is held at a known
point (an async save between its writes and its commit, a wrapped write of ``common.pt``), a version is
made old through the clock its name is drawn from, and each wait is for an object to appear."""

import os
import signal
import subprocess
import sys
import time

import pytest

import lightning_distckpt as ldc
from dist_utils import run_distributed
from lightning_distckpt.cli.main import main
from lightning_distckpt.core.errors import SaveFailedError
from lightning_distckpt.storage import s3 as s3_mod
from lightning_distckpt.storage import s3_live
from lightning_distckpt.storage.s3_store import S3Store
from lightning_distckpt.storage.s3_versions import find_s3_leftovers, remove_version
from lightning_distckpt.storage.store import LeftoverChanged

pytest.importorskip("moto.server")
from s3_helpers import check, client, keys, marker, state, template  # noqa: E402

HOURS_2 = 7200


def _wait_for(condition, what, limit_s=60.0):
    """Poll ``condition()`` (an object appearing) until true; the limit only turns a hang into a failure."""
    deadline = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.01)


def _versions(endpoint, bucket, prefix="ck"):
    return {k.split("/")[1] for k in keys(endpoint, bucket) if k.startswith(f"{prefix}/v-")}


def _keepers(bucket):
    """This process's running keepers of versions in ``bucket`` (other tests' saves are not this test's)."""
    return [url for url in s3_live.running_keepers() if url.startswith(f"s3://{bucket}/")]


def _has(endpoint, bucket, prefix):
    return bool(client(endpoint).list_objects_v2(Bucket=bucket, Prefix=prefix).get("KeyCount"))


class _TwoHoursAgo:
    """The clock a version's name is drawn from (s3.version_token), two hours behind: the save then looks
    older than any bound, as one that has run that long does."""

    @staticmethod
    def time():
        return time.time() - HOURS_2


def test_a_clean_between_the_writes_and_the_commit_never_commits_the_version(bucket, endpoint, monkeypatch, capsys):
    """``clean --older-than 0`` runs while the save writes: it deletes what it listed (the claim, rank 0's
    store), and ``common.pt`` is written after it. The commit found ``common.pt`` and committed a version
    whose arrays were gone: a checkpoint that looked complete and did not load. Now it is refused."""
    url = f"s3://{bucket}/ck"
    ldc.save(state(1), url)
    first = marker(endpoint, bucket, "ck")["version"]
    real_write = s3_mod.write_object

    def clean_then_write(version_url, name, data, options):  # common.pt, beside rank 0's shard writes
        version = version_url.rsplit("/", 1)[1]
        _wait_for(lambda: _has(endpoint, bucket, f"ck/{version}/data/rank_00000/manifest.ocdbt"), "rank 0's store")
        assert main(["clean", url, "--older-than", "0"]) == 0
        real_write(version_url, name, data, options)

    monkeypatch.setattr(s3_mod, "write_object", clean_then_write)
    with pytest.raises(SaveFailedError, match="deleted while it ran"):
        ldc.save(state(2), url)
    assert "uncommitted" in capsys.readouterr().out  # clean did remove the running save's version
    assert marker(endpoint, bucket, "ck")["version"] == first
    check(ldc.load(template(), url), 1)
    assert _versions(endpoint, bucket) == {first}  # the failed save's common.pt discarded


def test_a_writer_store_deleted_before_the_commit_never_commits_the_version(bucket, endpoint):
    """An async save held between its writes and its commit; rank 0's store is deleted meanwhile (a
    lifecycle rule, a hand-made cleanup), its claim and common.pt left. The commit named the version."""
    url = f"s3://{bucket}/ck"
    ldc.save(state(1), url)
    first = marker(endpoint, bucket, "ck")["version"]
    request = ldc.save(state(2), url, async_save=ldc.AsyncSaver())
    request.wait()  # every write done, nothing committed
    version = (_versions(endpoint, bucket) - {first}).pop()
    store = [k for k in keys(endpoint, bucket) if k.startswith(f"ck/{version}/data/rank_00000/")
             and "/claim-" not in k]
    assert store
    for key in store:
        client(endpoint).delete_object(Bucket=bucket, Key=key)
    with pytest.raises(SaveFailedError, match=r"the store of rank\(s\) \[0\] is missing"):
        request.finalize()
    assert marker(endpoint, bucket, "ck")["version"] == first
    check(ldc.load(template(), url), 1)


def test_a_running_save_older_than_the_bound_is_kept_by_clean_and_by_removal(bucket, endpoint, monkeypatch, capsys):
    """A save started two hours ago (by its version's name) still running: ``clean`` with its default
    bound and a removal of the checkpoint (top-k, another job) deleted its version, and its commit then
    failed. Its liveness marks now date it, and it commits."""
    url = f"s3://{bucket}/ck"
    ldc.save(state(1), url)
    first = marker(endpoint, bucket, "ck")["version"]
    monkeypatch.setenv(s3_live.ALIVE_PERIOD_ENV, "0.05")
    monkeypatch.setattr(s3_mod, "time", _TwoHoursAgo)
    request = ldc.save(state(2), url, async_save=ldc.AsyncSaver())
    request.wait()
    version = (_versions(endpoint, bucket) - {first}).pop()
    assert s3_mod.version_started(version) < time.time() - HOURS_2 + 60
    _wait_for(lambda: _has(endpoint, bucket, f"ck/{version}/data/rank_00000/alive-"), "a liveness mark")
    assert main(["clean", url]) == 0
    assert "marked live by its save" in capsys.readouterr().out
    assert S3Store(url).remove()  # the committed checkpoint goes, the running save's version stays
    assert _versions(endpoint, bucket) == {version}
    request.finalize()
    assert marker(endpoint, bucket, "ck")["version"] == version
    check(ldc.load(template(), url), 2)
    assert _keepers(bucket) == []


def test_a_version_marked_live_after_it_was_listed_is_not_removed(bucket, endpoint, monkeypatch):
    """``clean`` lists, then removes version by version: one whose save marked it live in between is
    still running, whatever ``--older-than`` said (0 here): kept, with the reason."""
    url = f"s3://{bucket}/ck"
    monkeypatch.setenv(s3_live.ALIVE_PERIOD_ENV, "0.05")
    request = ldc.save(state(2), url, async_save=ldc.AsyncSaver())
    request.wait()
    (version,) = _versions(endpoint, bucket)
    _wait_for(lambda: _has(endpoint, bucket, f"ck/{version}/data/rank_00000/alive-"), "a liveness mark")
    (left,) = find_s3_leftovers(url)
    assert left.verdict(0.0) == "remove" and left.alive_unix is not None
    def marked_since():
        found = [k.split("/", 2)[2] for k in keys(endpoint, bucket) if k.startswith(f"ck/{version}/")]
        return (s3_live.mark_time(found) or 0) > left.alive_unix

    _wait_for(marked_since, "a mark of a later second")
    with pytest.raises(LeftoverChanged, match="marked it live .* after it was listed"):
        remove_version(left)
    request.finalize()
    check(ldc.load(template(), url), 2)


def test_the_marks_stop_at_the_commit_and_at_a_failure(bucket, endpoint, monkeypatch):
    """A failed save's marks stop before its discard lists the version (no mark lands after it: nothing
    of the version is left), and a committed save's stop with its commit."""
    url = f"s3://{bucket}/ck"
    monkeypatch.setenv(s3_live.ALIVE_PERIOD_ENV, "0.01")
    ldc.save(state(1), url)
    first = marker(endpoint, bucket, "ck")["version"]
    assert _keepers(bucket) == []

    def fail_once_marked(version_url, name, data, options):
        version = version_url.rsplit("/", 1)[1]
        _wait_for(lambda: _has(endpoint, bucket, f"ck/{version}/data/rank_00000/alive-"), "a liveness mark")
        raise OSError("network down")

    monkeypatch.setattr(s3_mod, "write_object", fail_once_marked)
    with pytest.raises(SaveFailedError, match="network down"):
        ldc.save(state(2), url)
    assert _keepers(bucket) == []
    assert _versions(endpoint, bucket) == {first}


def test_an_abandoned_save_stops_marking_when_its_store_is_collected(bucket, endpoint, monkeypatch):
    """A save that neither commits nor discards (a rank lost in its handshake) stops marking its version
    once the save's store object is gone; the version is then a leftover like a killed save's."""
    import gc

    monkeypatch.setenv(s3_live.ALIVE_PERIOD_ENV, "0.01")
    store = S3Store(f"s3://{bucket}/ck")
    version = store.new_staging()
    assert _keepers(bucket) == [version]
    del store
    gc.collect()
    assert _keepers(bucket) == []


_KILLED_WHILE_MARKING = """
import os, signal, time, torch, lightning_distckpt as ldc
from lightning_distckpt.storage import s3
def commit(version_url, metadata_json, marker_json, options):
    store = s3.ObjectStore(version_url, options)
    while not store.list_keys("data/rank_00000/alive-"):  # marked live at least once
        time.sleep(0.01)
    os.kill(os.getpid(), signal.SIGKILL)  # kill -9 before the marker
s3.commit = commit
ldc.save({"w": ldc.ShardedTensor.from_rank_offsets("w", torch.full((8, 6), 9.0)), "step": 9}, os.environ["URL"])
"""


def test_a_killed_save_stops_marking_and_is_removed_after_the_bound(bucket, endpoint, monkeypatch, capsys):
    url = f"s3://{bucket}/ck"
    monkeypatch.setenv("URL", url)
    monkeypatch.setenv(s3_live.ALIVE_PERIOD_ENV, "0.05")
    run = subprocess.run([sys.executable, "-c", _KILLED_WHILE_MARKING], env=os.environ.copy(), timeout=120)
    assert run.returncode == -signal.SIGKILL
    killed = time.time()
    (left,) = find_s3_leftovers(url)
    assert left.alive_unix is not None and left.alive_unix <= killed
    assert main(["clean", url, "--older-than", "600"]) == 0 and "a save may still be running" in capsys.readouterr().out
    bound = 1.0  # the kill's second has passed: every mark it wrote is at least this old (marks are whole seconds)
    _wait_for(lambda: time.time() >= int(killed) + 1 + bound, "the bound past the kill")
    assert main(["clean", url, "--older-than", str(bound)]) == 0
    assert _versions(endpoint, bucket) == set()


def _save_refused_on_rank_1(rank, world, url):
    import torch  # noqa: F401 - the ranks' own imports
    from lightning_distckpt.core.errors import CheckpointingError

    bad = {"x/y": torch.zeros(4), "x": {"y": torch.zeros(4)}} if rank == 1 else {"x": {"y": torch.zeros(4)}}
    try:
        ldc.save(bad, url)
    except CheckpointingError as e:
        return type(e).__name__, [u for u in s3_live.running_keepers() if u.startswith(url)]
    return "saved", []


def test_a_save_failing_in_its_handshake_leaves_no_claimed_version(bucket, endpoint):
    """Rank 0 names (claims, marks) the version before the handshake; a save refused there by another rank
    discards it: no claim left for ``clean``, no keeper marking it."""
    import torch

    url = f"s3://{bucket}/ck"
    ldc.save({"x": {"y": torch.ones(4)}}, url)
    before = _versions(endpoint, bucket)
    results = run_distributed(_save_refused_on_rank_1, 2, url)
    assert results == [("ShardingError", [])] * 2, results
    assert _versions(endpoint, bucket) == before
