"""``s3://`` checkpoints, second red-team pass (moto's S3 server on loopback, this folder's fixtures):
keys whose ``..`` makes a request reach another object, sibling prefixes, an overwrite racing a
reader, a save inside another checkpoint's version, and an endpoint holding a password. Nothing
that is not ours is deleted, and no error prints a secret."""

import contextlib
import io
import time

import pytest

import lightning_distckpt as ldc
from lightning_distckpt.cli.main import main
from lightning_distckpt.core.errors import ArgumentError, CheckpointingError, SaveFailedError
from lightning_distckpt.storage import s3 as s3_mod
from dist_utils import free_port

pytest.importorskip("moto.server")
from s3_helpers import check, client, keys, marker, state, template  # noqa: E402

OLD = f"v-{int(time.time()) - 100_000:08x}abcd"  # a version a save started long ago: clean removes it
# From <prefix>/<version>/data/rank_00000/ back to the bucket's root: a request for this key (curl
# resolves '..' in the URL path) is a request for the bucket's object "precious".
ESCAPE = "data/rank_00000/../../../../precious"


def _put(endpoint, bucket, key, body=b"{}"):
    client(endpoint).put_object(Bucket=bucket, Key=key, Body=body)


def _quiet(argv):
    with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.redirect_stderr(io.StringIO()) as err:
        code = main(argv)
    return code, out.getvalue() + err.getvalue()


def _remove_by_top_k(url):
    from lightning_distckpt.lightning import DistCheckpointIO

    DistCheckpointIO().remove_checkpoint(url)  # what ModelCheckpoint's top-k removal calls


def _fail_after_planting(endpoint, bucket, monkeypatch):
    """A save whose common.pt write fails after someone put the escaping key into its version."""
    def plant_then_fail(version_url, name, data, options):
        _put(endpoint, bucket, version_url.split("/", 3)[3] + "/" + ESCAPE, b"planted")
        raise OSError("network down")

    monkeypatch.setattr(s3_mod, "write_object", plant_then_fail)
    with pytest.raises(SaveFailedError, match="network down"):
        ldc.save(state(2), f"s3://{bucket}/ck")


@pytest.mark.parametrize("how", ["clean", "overwrite", "top-k removal", "failed save"])
def test_a_dot_dot_key_inside_a_version_never_deletes_an_object_elsewhere(bucket, endpoint, monkeypatch, how):
    """A key ``ck/v-x/data/rank_00000/../../../../precious`` is a name a save writes by the pattern
    (``data/rank_NNNNN/...``), and a DELETE of it deleted the bucket's ``precious`` (outside the
    checkpoint, not ours), while the key itself stayed: by ``clean`` (which said "removed"), by the
    commit of an overwrite deleting the previous version, by top-k removal and by a failed save
    discarding its version. Such a version is now not provably ours: kept, with its reason."""
    url = f"s3://{bucket}/ck"
    _put(endpoint, bucket, "precious", b"not ours")
    if how == "failed save":
        _fail_after_planting(endpoint, bucket, monkeypatch)
        left = [k for k in keys(endpoint, bucket) if k != "precious"]
        assert len(left) == 1 and left[0].endswith("/" + ESCAPE), left  # its own objects gone, the planted one not
    else:
        ldc.save(state(1), url)
        version = OLD if how == "clean" else marker(endpoint, bucket, "ck")["version"]
        _put(endpoint, bucket, f"ck/{version}/{ESCAPE}", b"planted")
        if how == "clean":
            code, out = _quiet(["clean", url])
            assert code == 0 and "kept" in out and "not provably ours" in out, out
        elif how == "overwrite":
            ldc.save(state(2), url)
            check(ldc.load(template(), url), 2)
        else:
            _remove_by_top_k(url)
            assert "ck/COMMITTED" not in keys(endpoint, bucket)
    assert client(endpoint).get_object(Bucket=bucket, Key="precious")["Body"].read() == b"not ours"


def test_a_top_k_removal_keeps_the_version_another_job_is_saving_to_the_same_name(bucket, endpoint, monkeypatch):
    """Two jobs on one run directory (a restarted job while its first copy still runs): one removes
    ``ck`` (top-k) while the other is saving to ``ck``. The removal deleted every version under ``ck``,
    the running save's too: its commit then failed ("common.pt is missing"), or, had common.pt been
    written after the removal, committed a version whose arrays were deleted. A version started less
    than ``LIVE_SAVE_S`` ago is left in place (as a directory's removal never touches the staging
    directory of a save to it). The removal is staged right before the running save's commit."""
    url = f"s3://{bucket}/ck"
    ldc.save(state(1), url)
    first = marker(endpoint, bucket, "ck")["version"]
    real_commit = s3_mod.commit

    def removed_by_the_other_job_then_commit(*args):
        _remove_by_top_k(url)
        real_commit(*args)

    monkeypatch.setattr(s3_mod, "commit", removed_by_the_other_job_then_commit)
    ldc.save(state(2), url)
    check(ldc.load(template(), url), 2)
    assert not any(f"/{first}/" in k for k in keys(endpoint, bucket))  # the removed checkpoint's version: gone


def test_an_object_name_that_would_reach_another_object_is_never_requested(bucket, endpoint):
    """The object store itself refuses such a name before any request (read, write, delete)."""
    _put(endpoint, bucket, "precious", b"not ours")
    store = s3_mod.ObjectStore(f"s3://{bucket}/a/b", ldc.StorageOptions())
    for call in (lambda: store.read("../../precious"), lambda: store.write("x/../../../precious", b"W"),
                 lambda: store.delete("../../precious"), lambda: store.delete_keys(["./../../precious"])):
        with pytest.raises(CheckpointingError, match="would make the request reach another object"):
            call()
    assert keys(endpoint, bucket) == ["precious"]


def test_siblings_sharing_a_name_prefix_are_never_touched(bucket, endpoint):
    """``ck2``, ``ck-old``, ``ck.bak``, an object named ``ck`` and a leftover of ``ck2``: an overwrite,
    ``inspect``, ``validate``, ``clean`` and removal of ``ck`` leave every one of their keys. (A guard:
    this held before this pass too.)"""
    url = f"s3://{bucket}/ck"
    for sibling in ("ck2", "ck-old", "ck.bak"):
        ldc.save(state(7), f"s3://{bucket}/{sibling}")
    _put(endpoint, bucket, "ck", b"an object, not a prefix")
    _put(endpoint, bucket, f"ck2/{OLD}/metadata.json")
    _put(endpoint, bucket, f"ck{OLD}/metadata.json")
    before = keys(endpoint, bucket)
    ldc.save(state(1), url)
    ldc.save(state(2), url)
    for command in ("inspect", "validate", "clean"):
        assert _quiet([command, url])[0] == 0
    _remove_by_top_k(url)
    assert keys(endpoint, bucket) == before
    check(ldc.load(template(), f"s3://{bucket}/ck2"), 7)


def test_a_load_racing_an_overwrite_opens_the_newer_checkpoint(bucket, monkeypatch):
    """An overwrite that commits between a reader's marker read and its metadata read deletes the
    version the reader just took: the load failed with "which has no metadata.json (deleted or
    damaged)", as if the checkpoint were broken (a reader polling a training run meets this). The
    overwrite is staged right after the reader's marker read."""
    url = f"s3://{bucket}/ck"
    ldc.save(state(1), url)
    real, staged = s3_mod.read_marker, []

    def marker_then_an_overwrite(store):
        got = real(store)
        if not staged:
            staged.append(True)
            ldc.save(state(2), url)
        return got

    monkeypatch.setattr(s3_mod, "read_marker", marker_then_an_overwrite)
    check(ldc.load(template(), url), 2)
    assert staged


def test_common_state_of_a_checkpoint_replaced_while_read_says_so(bucket):
    """The arrays and objects of a version an overwrite deleted say "replaced while being read; load it
    again"; common.pt said only "is missing"."""
    from lightning_distckpt.reading.checkpoint import OpenedCheckpoint

    url = f"s3://{bucket}/ck"
    ldc.save(state(1), url)
    opened = OpenedCheckpoint.open(url)
    ldc.save(state(2), url)
    with pytest.raises(CheckpointingError, match="was replaced while being read"):
        opened.common_bytes()
    check(ldc.load(template(), url), 2)


@pytest.mark.parametrize("target", ["{version}/data/rank_00000/inner", "{version}/sub", "COMMITTED"])
def test_a_save_inside_another_checkpoints_version_or_to_its_marker_is_refused(bucket, endpoint, target):
    """A save into ``ck/<version>/data/rank_00000/inner`` succeeded, and the next overwrite of ``ck``
    deleted it (every key there is a name ``ck``'s save writes); a save to ``ck/COMMITTED`` succeeded
    and its load gave ``ck``'s state, not the one saved (the URL of a marker names its checkpoint)."""
    url = f"s3://{bucket}/ck"
    ldc.save(state(1), url)
    before = keys(endpoint, bucket)
    inner = f"{url}/{target.format(version=marker(endpoint, bucket, 'ck')['version'])}"
    with pytest.raises(ArgumentError, match="save elsewhere") as info:
        ldc.save(state(2), inner)
    assert inner in str(info.value)
    assert keys(endpoint, bucket) == before
    check(ldc.load(template(), url), 1)


@pytest.mark.parametrize("where", ["unreachable", "the server", "no scheme"])
def test_an_endpoint_holding_a_password_is_refused_without_printing_it(bucket, endpoint, monkeypatch, where):
    """``AWS_ENDPOINT_URL=http://admin:hunter2@host:port``: the password was printed in every error
    ("the endpoint http://admin:hunter2@... is unreachable", "Endpoint admin:hunter2@... has invalid
    scheme"), and against the real server the S3 client (which never sends it) answered "the bucket
    does not exist"."""
    host = f"127.0.0.1:{free_port()}" if where == "unreachable" else endpoint.split("://", 1)[1]
    monkeypatch.setenv("AWS_ENDPOINT_URL", ("" if where == "no scheme" else "http://") + f"admin:hunter2@{host}")
    url = f"s3://{bucket}/ck"
    for call in (lambda: ldc.save(state(1), url), lambda: ldc.load(template(), url)):
        with pytest.raises(ArgumentError, match="holds a user name or password") as info:
            call()
        text = str(info.value)
        assert url in text and "hunter2" not in text and "admin" not in text and "\n" not in text, text
    code, out = _quiet(["inspect", url])
    assert code == 2 and url in out and "hunter2" not in out, out
    assert keys(endpoint, bucket) == []
