"""The command line on ``s3://`` checkpoints, against moto's S3 server on loopback (the fixtures of
tests/s3/test_s3.py): ``inspect``, ``validate``, ``convert`` and ``clean``, which removes the versions
no commit marker names and nothing that is not ours."""

import json
import time

import pytest
import torch

import lightning_distckpt as ldc
from lightning_distckpt.cli.main import main
from lightning_distckpt.core.errors import CheckpointingError
from lightning_distckpt.storage import s3 as s3_mod

pytest.importorskip("moto.server")
from s3_helpers import check as _check, client as _client, keys as _keys, marker as _marker  # noqa: E402
from s3_helpers import state as _state, template as _template  # noqa: E402


def _run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def _leave_uncommitted_version(url, monkeypatch, seed):
    """A save killed after every write but the marker (as kill -9 leaves it: nothing cleans up)."""
    def killed_before_the_marker(version_url, metadata_json, marker_json, options):
        raise CheckpointingError("killed before the marker")

    with monkeypatch.context() as m:
        m.setattr(s3_mod, "commit", killed_before_the_marker)
        m.setattr(s3_mod, "discard", lambda *a: None)
        with pytest.raises(CheckpointingError, match="killed before the marker"):
            ldc.save(_state(seed), url)


def _copy_version(endpoint, bucket, prefix, src, dst, extra=()):
    """Copy version ``src``'s objects to version ``dst`` (plus ``extra`` names): a leftover with
    another start time in its token, made through the S3 API as a killed save's would be."""
    client = _client(endpoint)
    for key in _keys(endpoint, bucket):
        if key.startswith(f"{prefix}/{src}/"):
            body = client.get_object(Bucket=bucket, Key=key)["Body"].read()
            client.put_object(Bucket=bucket, Key=key.replace(f"/{src}/", f"/{dst}/", 1), Body=body)
    for name in extra:
        client.put_object(Bucket=bucket, Key=f"{prefix}/{dst}/{name}", Body=b"user data")


def _old_token(hours):
    return f"v-{int(time.time()) - hours * 3600:08x}abcd"


def test_clean_removes_uncommitted_versions_and_nothing_else(bucket, endpoint, monkeypatch, capsys):
    url = f"s3://{bucket}/runs/ck"
    ldc.save(_state(1), url)
    committed = _marker(endpoint, bucket, "runs/ck")["version"]
    _leave_uncommitted_version(url, monkeypatch, 2)
    recent = ({k.split("/")[2] for k in _keys(endpoint, bucket)} - {"COMMITTED", committed}).pop()
    old, foreign = _old_token(2), _old_token(3)
    _copy_version(endpoint, bucket, "runs/ck", recent, old)
    _copy_version(endpoint, bucket, "runs/ck", recent, foreign, extra=["notes.txt"])  # a name we never write
    client = _client(endpoint)
    client.put_object(Bucket=bucket, Key="runs/ck/README", Body=b"not a version")
    client.put_object(Bucket=bucket, Key="runs/other/v-0123456789ab/data/rank_00000/x", Body=b"no marker here")
    before = _keys(endpoint, bucket)

    code, out, _ = _run(capsys, "clean", f"s3://{bucket}/runs", "--dry-run", "--json")
    assert code == 0 and _keys(endpoint, bucket) == before
    actions = {a["path"].rsplit("/", 1)[1]: a for a in json.loads(out)}
    assert actions[old]["action"] == "would remove"
    assert actions[recent]["action"] == "kept" and "a save may still be running" in actions[recent]["reason"]
    assert actions[foreign]["action"] == "kept" and "notes.txt" in actions[foreign]["reason"]
    assert actions["v-0123456789ab"]["action"] == "kept"  # no start time in its token: age unknown
    assert committed not in actions

    code, out, _ = _run(capsys, "clean", url)  # the checkpoint itself: its own versions
    assert code == 0 and f"removed      {url}/{old}" in out, out
    left = _keys(endpoint, bucket)
    assert not any(f"/{old}/" in k for k in left)
    assert set(before) - set(left) == {k for k in before if f"/{old}/" in k}

    code, out, _ = _run(capsys, "clean", url, "--older-than", "0")
    assert code == 0 and f"removed      {url}/{recent}" in out and "refused: not provably ours" in out
    left = _keys(endpoint, bucket)
    assert {k.split("/")[2] for k in left if k.startswith("runs/ck/")} == {"COMMITTED", "README", committed, foreign}
    assert "runs/other/v-0123456789ab/data/rank_00000/x" in left
    _check(ldc.load(_template(), url), 1)  # the committed checkpoint untouched


def test_inspect_and_validate_an_s3_checkpoint(bucket, endpoint, monkeypatch, capsys):
    url = f"s3://{bucket}/ck"
    ldc.save(_state(3), url)
    _leave_uncommitted_version(url, monkeypatch, 4)
    version = _marker(endpoint, bucket, "ck")["version"]
    code, out, _ = _run(capsys, "inspect", url, "--json")
    summary = json.loads(out)
    assert code == 0 and summary["path"] == f"{url}/{version}" and summary["committed"]
    assert {t["key"] for t in summary["tensors"]} == {"w", "h", "n"} and summary["data_files"] > 0
    assert summary["common_bytes"] > 0 and len(summary["leftovers"]) == 1
    code, out, _ = _run(capsys, "inspect", url)
    assert code == 0 and "sizes not listed" in out and f"lightning-distckpt clean {url}" in out

    code, out, _ = _run(capsys, "validate", url, "--json")
    report = json.loads(out)
    assert code == 0 and report["ok"] and report["shards"] == 3 and report["objects"] == 1, report
    client = _client(endpoint)
    for key in _keys(endpoint, bucket):
        if key.startswith(f"ck/{version}/data/"):
            client.delete_object(Bucket=bucket, Key=key)
    code, out, _ = _run(capsys, "validate", url)
    assert code == 1 and f"rank 0: no objects under {url}/{version}/data/rank_00000" in out, out


def test_convert_to_and_from_s3(bucket, tmp_path, capsys):
    url = f"s3://{bucket}/ck"
    ldc.save(_state(5), url)
    code, out, _ = _run(capsys, "convert", url, str(tmp_path / "whole.pt"))
    assert code == 0 and out.startswith(f"{url} -> "), out
    assert torch.equal(torch.load(tmp_path / "whole.pt")["tensors"]["w"], _state(5)["w"].data)
    code, out, err = _run(capsys, "convert", str(tmp_path / "whole.pt"), f"s3://{bucket}/imported")
    assert code == 0, err
    _check(ldc.load(_template(), f"s3://{bucket}/imported"), 5)
    code, _, err = _run(capsys, "convert", url, f"s3://{bucket}/zarr", "--to", "distckpt", "--layout", "zarr")
    assert code == 0, err
    _check(ldc.load(_template(), f"s3://{bucket}/zarr"), 5)
    code, _, err = _run(capsys, "convert", f"s3://{bucket}/zarr", str(tmp_path / "local"), "--to", "distckpt")
    assert code == 0, err
    _check(ldc.load(_template(), str(tmp_path / "local")), 5)
    code, _, err = _run(capsys, "convert", url, url, "--to", "distckpt")
    assert code == 2 and "is the source" in err


@pytest.mark.parametrize("command", ["inspect", "validate", "clean"])
def test_cli_errors_on_s3_are_one_line_naming_the_url(bucket, capsys, command):
    for url, why in (("s3://no-such-bucket-here/ck", "the bucket does not exist"),
                     (f"s3://{bucket}/nothing", "no commit marker")):
        if command == "clean" and why == "no commit marker":
            code, out, err = _run(capsys, command, url)  # nothing to clean is not an error
            assert code == 0 and out.strip() == f"{url}: no leftover staging directories"
            continue
        code, _, err = _run(capsys, command, url)
        assert code == 2 and url in err and why in err and err.count("\n") == 1, err
