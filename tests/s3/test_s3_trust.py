"""Hostile and concurrent object listings against ``clean``, ``remove_checkpoint`` and an overwrite of an
``s3://`` checkpoint (moto's S3 server on loopback, this folder's fixtures): nothing that is not ours is
deleted, a version a save committed after ``clean`` listed it is not deleted, and a key no URL can name
does not stop ``clean``."""

import json
import time

import pytest

import lightning_distckpt as ldc
from lightning_distckpt.cli.main import main
from lightning_distckpt.core.errors import CheckpointingError
from lightning_distckpt.storage import s3_versions

pytest.importorskip("moto.server")
from s3_helpers import check, client, keys, marker, state, template  # noqa: E402

OLD = f"v-{int(time.time()) - 100_000:08x}abcd"  # a version a save started long ago: clean removes it


def _put(endpoint, bucket, key, body=b"{}"):
    client(endpoint).put_object(Bucket=bucket, Key=key, Body=body)


def _clean(capsys, url):
    code = main(["clean", url])
    out = capsys.readouterr()
    return code, out.out + out.err


def test_clean_never_deletes_a_foreign_version_a_slash_run_names(bucket, endpoint, capsys):
    """``runs//v-x/`` holds only names of ours; ``runs/v-x/`` (another prefix: S3 keys are literal)
    holds someone's file. The first was removed as ``runs/v-x`` (URLs collapse ``/`` runs), deleting the
    file ``clean`` itself reported as kept."""
    _put(endpoint, bucket, f"root/runs/{OLD}/precious.txt", b"not ours")
    _put(endpoint, bucket, f"root/runs//{OLD}/metadata.json")
    code, out = _clean(capsys, f"s3://{bucket}/root")
    assert code == 0, out
    assert keys(endpoint, bucket) == [f"root/runs//{OLD}/metadata.json", f"root/runs/{OLD}/precious.txt"]


def test_a_dot_dot_key_does_not_stop_clean(bucket, endpoint, capsys):
    """A key ``x/../v-.../metadata.json`` (no URL names its location) was an ArgumentError for the
    whole tree: nothing could be cleaned. It is left alone, the real leftover removed."""
    _put(endpoint, bucket, f"root/x/../{OLD}/metadata.json")
    _put(endpoint, bucket, f"root/ck/{OLD}/metadata.json")
    code, out = _clean(capsys, f"s3://{bucket}/root")
    assert code == 0, out
    assert keys(endpoint, bucket) == [f"root/x/../{OLD}/metadata.json"]


def test_clean_keeps_a_version_committed_after_its_listing(bucket, endpoint):
    """A save that started before ``--older-than`` commits its version between ``clean``'s listing and
    its removal: the committed checkpoint must stay loadable."""
    url, s3 = f"s3://{bucket}/ck", client(endpoint)
    ldc.save(state(1), url)
    committed = marker(endpoint, bucket, "ck")
    for key in keys(endpoint, bucket):  # the long-running save's version: its objects, an old name
        if key.startswith(f"ck/{committed['version']}/"):
            s3.copy_object(Bucket=bucket, Key=key.replace(committed["version"], OLD),
                           CopySource={"Bucket": bucket, "Key": key})
    (found,) = [lo for lo in s3_versions.find_s3_leftovers(url) if lo.path.endswith(OLD)]
    assert found.verdict(600) == "remove"
    s3.put_object(Bucket=bucket, Key="ck/COMMITTED", Body=json.dumps(dict(committed, version=OLD)).encode())
    before = keys(endpoint, bucket)
    with pytest.raises(CheckpointingError, match="committed meanwhile"):
        s3_versions.remove_version(found)
    assert keys(endpoint, bucket) == before
    check(ldc.load(template(), url), 1)


def test_clean_keeps_an_object_put_into_a_leftover_after_its_listing(bucket, endpoint):
    url = f"s3://{bucket}/ck"
    _put(endpoint, bucket, f"ck/{OLD}/metadata.json")
    (found,) = s3_versions.find_s3_leftovers(url)
    assert found.verdict(600) == "remove"
    _put(endpoint, bucket, f"ck/{OLD}/notes.txt", b"not ours")
    with pytest.raises(CheckpointingError, match="notes.txt"):
        s3_versions.remove_version(found)
    assert keys(endpoint, bucket) == [f"ck/{OLD}/metadata.json", f"ck/{OLD}/notes.txt"]


def test_an_overwrite_keeps_foreign_objects_in_the_previous_version(bucket, endpoint):
    """The commit of an overwrite deleted every object under the previous version's prefix, one no save
    writes included (remove_checkpoint and clean keep such objects)."""
    url = f"s3://{bucket}/ck"
    ldc.save(state(1), url)
    previous = marker(endpoint, bucket, "ck")["version"]
    _put(endpoint, bucket, f"ck/{previous}/notes.txt", b"not ours")
    ldc.save(state(2), url)
    assert f"ck/{previous}/notes.txt" in keys(endpoint, bucket)
    check(ldc.load(template(), url), 2)


def test_an_overwrite_still_removes_the_previous_version(bucket, endpoint):
    url = f"s3://{bucket}/ck"
    ldc.save(state(1), url)
    ldc.save(state(2), url)
    version = marker(endpoint, bucket, "ck")["version"]
    assert all(k == "ck/COMMITTED" or k.startswith(f"ck/{version}/") for k in keys(endpoint, bucket))


def test_clean_goes_on_past_a_leftover_that_changed_since_its_listing(bucket, endpoint, capsys, monkeypatch):
    """A leftover that changed between ``clean``'s listing and its removal is kept and reported, and
    ``clean`` goes on with the others (it stopped with an error, exit 2, the rest not cleaned). The
    concurrent writer is staged right after the listing."""
    from lightning_distckpt.storage.s3_store import S3Store

    _put(endpoint, bucket, f"root/a/{OLD}/metadata.json")
    _put(endpoint, bucket, f"root/b/{OLD}/metadata.json")
    listed = S3Store.find_leftovers

    def listing_then_a_writer(self):
        found = listed(self)
        _put(endpoint, bucket, f"root/a/{OLD}/notes.txt", b"not ours")
        return found

    monkeypatch.setattr(S3Store, "find_leftovers", listing_then_a_writer)
    code, out = _clean(capsys, f"s3://{bucket}/root")
    assert code == 0, out
    assert keys(endpoint, bucket) == [f"root/a/{OLD}/metadata.json", f"root/a/{OLD}/notes.txt"]
    assert "kept" in out and "notes.txt" in out and "removed" in out, out


@pytest.mark.parametrize("bad", ["ck\nx", "ck\tx", "a/b\x7f"])  # NUL: refused by every path check
def test_a_control_character_in_an_s3_url_is_refused_before_any_request(bucket, endpoint, bad):
    """A newline in a key went into the requests, and the server's raw answer into the error."""
    from lightning_distckpt.core.errors import ArgumentError

    url = f"s3://{bucket}/{bad}"
    for call in (lambda: ldc.save(state(1), url), lambda: ldc.load(template(), url)):
        with pytest.raises(ArgumentError, match="control characters are not allowed"):
            call()
    assert keys(endpoint, bucket) == []
