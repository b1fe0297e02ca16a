"""``s3://`` checkpoints against a real S3-protocol server on loopback (moto's server mode, started
and stopped by this module): single- and two-process saves, resharding loads, overwrites, a save
that never committed, and errors (missing bucket, unreachable endpoint) on every rank."""

import os
import signal
import subprocess
import sys

import pytest
import torch

import lightning_distckpt as ldc
from lightning_distckpt.core.errors import CheckpointingError, IncompleteCheckpointError, SaveFailedError
from lightning_distckpt.storage import s3 as s3_mod
from dist_utils import free_port, run_distributed

pytest.importorskip("moto.server")

from s3_helpers import check as _check, keys as _keys, marker as _marker  # noqa: E402
from s3_helpers import save_and_load_errors, state as _state, template as _template  # noqa: E402


def test_save_and_load_one_process_bit_exact(bucket, endpoint):
    url = f"s3://{bucket}/runs/ck"
    ldc.save(_state(3), url)
    _check(ldc.load(_template(), url), 3)
    assert ldc.load_common_state_dict(url) == {"step": 3}
    meta = ldc.load_tensors_metadata(url)
    assert meta["w"].global_shape == (8, 6) and meta["h"].dtype == torch.bfloat16
    version = _marker(endpoint, bucket, "runs/ck")["version"]
    keys = _keys(endpoint, bucket)
    assert "runs/ck/COMMITTED" in keys and f"runs/ck/{version}/metadata.json" in keys
    assert f"runs/ck/{version}/common.pt" in keys
    assert f"runs/ck/{version}/data/rank_00000/manifest.ocdbt" in keys  # arrays: OCDBT over the s3 kvstore
    assert all(k == "runs/ck/COMMITTED" or k.startswith(f"runs/ck/{version}/") for k in keys)


def _save_then_reshard(rank, world, url):
    ldc.save(_state(5, rank, world), url)
    _check(ldc.load(_template(rank, world), url), 5, rank, world)
    ldc.save(_state(6, rank, world), url)  # an overwrite, by every rank
    _check(ldc.load(_template(rank, world), url, loader="every_rank"), 6, rank, world)
    return True


@pytest.mark.parametrize("world", [1, 2])
def test_save_resharding_load_and_overwrite_on_gloo_ranks(bucket, endpoint, world):
    url = f"s3://{bucket}/ck"
    assert run_distributed(_save_then_reshard, world, url) == [True] * world
    version = _marker(endpoint, bucket, "ck")["version"]
    stored = _keys(endpoint, bucket)
    assert all(k == "ck/COMMITTED" or k.startswith(f"ck/{version}/") for k in stored), stored  # old version gone
    assert sum(k.endswith("manifest.ocdbt") for k in stored) == world  # one store per writing rank
    _check(ldc.load(_template(), url), 6)  # and from one process, resharded again


def test_a_save_that_never_committed_is_ignored_and_the_previous_loads(bucket, endpoint, monkeypatch):
    url = f"s3://{bucket}/ck"
    ldc.save(_state(1), url)
    committed = _marker(endpoint, bucket, "ck")

    def killed_before_the_marker(version_url, metadata_json, marker_json, options):
        s3_mod.ObjectStore(version_url, options).write("metadata.json", metadata_json.encode())
        raise CheckpointingError("rank 0 killed before writing the marker")

    monkeypatch.setattr(s3_mod, "commit", killed_before_the_marker)
    monkeypatch.setattr(s3_mod, "discard", lambda *a: None)  # as after kill -9: nothing cleans up
    with pytest.raises(SaveFailedError, match="killed before writing the marker"):
        ldc.save(_state(2), url)
    partial = {k.split("/")[1] for k in _keys(endpoint, bucket) if k != "ck/COMMITTED"}
    assert len(partial) == 2 and committed["version"] in partial  # the partial version's objects are there
    assert _marker(endpoint, bucket, "ck") == committed
    _check(ldc.load(_template(), url), 1)


def test_a_failed_save_removes_its_version_and_keeps_the_previous(bucket, endpoint, monkeypatch):
    url = f"s3://{bucket}/ck"
    ldc.save(_state(1), url)
    before = _keys(endpoint, bucket)
    monkeypatch.setattr(s3_mod, "write_object", lambda *a: (_ for _ in ()).throw(OSError("network down")))
    with pytest.raises(SaveFailedError, match="network down"):
        ldc.save(_state(2), url)
    assert _keys(endpoint, bucket) == before
    _check(ldc.load(_template(), url), 1)


def test_a_missing_bucket_is_one_clear_error_on_every_rank(bucket):
    url = "s3://no-such-bucket-here/ck"
    for errors in run_distributed(save_and_load_errors, 2, url):
        assert len(errors) == 2
        for text in errors:
            assert url in text and "the bucket does not exist" in text and "\n" not in text, text


def test_no_checkpoint_at_a_prefix_and_an_unreachable_endpoint(bucket, monkeypatch):
    with pytest.raises(IncompleteCheckpointError, match=f"s3://{bucket}/nothing: no commit marker"):
        ldc.load(_template(), f"s3://{bucket}/nothing")
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    for call in (lambda: ldc.save(_state(1), f"s3://{bucket}/ck"), lambda: ldc.load(_template(), f"s3://{bucket}/ck")):
        with pytest.raises(CheckpointingError, match="is unreachable") as info:
            call()
        assert f"s3://{bucket}/ck" in str(info.value) and "\n" not in str(info.value)


def test_endpoint_and_region_from_storage_options(bucket, endpoint, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")  # wrong: the options win
    opts = ldc.StorageOptions(s3_endpoint=endpoint, s3_region="us-east-1", s3_credentials="environment")
    ldc.save(_state(4), f"s3://{bucket}/ck", storage=opts)
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    _check(ldc.load(_template(), f"s3://{bucket}/ck"), 4)


def _async_saves(rank, world, url):
    saver = ldc.AsyncSaver()
    for seed in (7, 8):
        request = ldc.save(_state(seed, rank, world), url, async_save=saver)
        request.finalize()
        _check(ldc.load(_template(rank, world), url), seed, rank, world)
    return saver.plan_cache.hits


def test_async_save_on_two_ranks_reuses_its_plan(bucket, endpoint):
    url = f"s3://{bucket}/ck"
    assert run_distributed(_async_saves, 2, url) == [1, 1]  # the second save reused the first one's plan
    assert len({k.split("/")[1] for k in _keys(endpoint, bucket)} - {"COMMITTED"}) == 1


_KILLED_SAVE = """
import os, signal, torch, lightning_distckpt as ldc
from lightning_distckpt.storage import s3
def commit(version_url, metadata_json, marker_json, options):
    s3.ObjectStore(version_url, options).write("metadata.json", metadata_json.encode())
    os.kill(os.getpid(), signal.SIGKILL)  # kill -9 after every write but the marker
s3.commit = commit
ldc.save({"w": ldc.ShardedTensor.from_rank_offsets("w", torch.full((8, 6), 9.0)), "step": 9}, os.environ["URL"])
"""


def test_kill_9_before_the_marker_leaves_the_previous_checkpoint_and_refuses_the_partial(bucket, endpoint,
                                                                                        monkeypatch):
    url = f"s3://{bucket}/ck"
    ldc.save(_state(1), url)
    committed = _marker(endpoint, bucket, "ck")["version"]
    monkeypatch.setenv("URL", url)
    assert subprocess.run([sys.executable, "-c", _KILLED_SAVE], env=os.environ.copy()).returncode == -signal.SIGKILL
    partial = {k.split("/")[1] for k in _keys(endpoint, bucket)} - {"COMMITTED", committed}
    assert len(partial) == 1
    assert _marker(endpoint, bucket, "ck")["version"] == committed
    _check(ldc.load(_template(), url), 1)
    with pytest.raises(IncompleteCheckpointError, match="no commit marker"):  # the partial version itself
        ldc.load(_template(), f"{url}/{partial.pop()}")


def test_a_load_whose_version_an_overwrite_deleted_says_so(bucket):
    from lightning_distckpt.reading.checkpoint import OpenedCheckpoint
    from lightning_distckpt.storage.base import ShardRead

    url = f"s3://{bucket}/ck"
    ldc.save(_state(1), url)
    opened = OpenedCheckpoint.open(url)
    ldc.save(_state(2), url)  # commits a new version, then deletes the one `opened` names
    reader = opened.reader()
    with pytest.raises(CheckpointingError, match="was replaced while being read"):
        reader.read_object(0, "obj", 0)
    dest = torch.zeros(8, 6)
    with pytest.raises(CheckpointingError, match="was replaced while being read"):
        reader.read_into([ShardRead("w", 0, 0, (slice(0, 8), slice(0, 6)), dest)])
    _check(ldc.load(_template(), url), 2)


def test_plain_zarr_layout_over_s3(bucket, endpoint):
    url = f"s3://{bucket}/ck"
    ldc.save(_state(2), url, storage=ldc.StorageOptions(layout="zarr"))
    _check(ldc.load(_template(), url), 2)
    assert any(k.endswith("/zarr.json") for k in _keys(endpoint, bucket))  # one object per array and chunk


def test_s3_settings_in_the_yaml_config_and_refused_values(tmp_path):
    from lightning_distckpt.core.errors import ArgumentError, ConfigError
    from lightning_distckpt.lightning.config import load_checkpoint_config

    (tmp_path / "ckpt.yaml").write_text("storage:\n  s3_endpoint: http://127.0.0.1:9000\n  s3_region: eu-west-1\n"
                                        "  s3_credentials: profile:training\n")
    storage = load_checkpoint_config(tmp_path / "ckpt.yaml").storage
    assert (storage.s3_endpoint, storage.s3_region, storage.s3_credentials) == (
        "http://127.0.0.1:9000", "eu-west-1", "profile:training")
    for bad in ({"s3_endpoint": "127.0.0.1:9000"}, {"s3_credentials": "keys"}, {"s3_retries": 0}):
        with pytest.raises(ConfigError):
            ldc.StorageOptions(**bad)
    for url in ("s3://Bad_Bucket/x", "s3://bucket/a/../b"):
        with pytest.raises(ArgumentError, match="checkpoint s3://"):
            ldc.save(_state(1), url, storage=ldc.StorageOptions(s3_credentials="anonymous"))


def test_access_denied_is_one_clear_line(bucket, monkeypatch):
    from moto import settings

    url = f"s3://{bucket}/ck"
    monkeypatch.setattr(settings, "INITIAL_NO_AUTH_ACTION_COUNT", 0)  # the server now checks keys: ours are unknown
    for call in (lambda: ldc.save(_state(1), url), lambda: ldc.load(_template(), url)):
        with pytest.raises(CheckpointingError, match="access denied") as info:
            call()
        assert url in str(info.value) and "\n" not in str(info.value)


def _killed_member(rank, port, url, queue):
    import datetime
    import torch.distributed as dist
    from lightning_distckpt.storage.tensorstore_io import TensorStoreIO

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=30))
    ldc.save(_state(1, rank, 2), url)
    if rank == 1:
        real_write = TensorStoreIO.write

        def write_then_die(self, *args, **kwargs):
            real_write(self, *args, **kwargs)
            os.kill(os.getpid(), signal.SIGKILL)  # kill -9 with this rank's part written, before the commit

        TensorStoreIO.write = write_then_die
    try:
        ldc.save(_state(2, rank, 2), url)
        queue.put("no error")
    except Exception as e:  # gloo reports the closed connection
        queue.put(f"{type(e).__name__}: {e}")


def test_kill_9_of_a_rank_mid_save_fails_the_others_and_the_previous_checkpoint_loads(bucket, endpoint):
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    url, port = f"s3://{bucket}/ck", free_port()
    procs = [ctx.Process(target=_killed_member, args=(r, port, url, queue)) for r in range(2)]
    for p in procs:
        p.start()
    msg = queue.get(timeout=90)
    for p in procs:
        p.join(timeout=30)
    assert procs[1].exitcode == -signal.SIGKILL
    assert msg.startswith("CollectiveError") and "may have died" in msg, msg  # a CheckpointingError
    committed = _marker(endpoint, bucket, "ck")["version"]
    partial = {k.split("/")[1] for k in _keys(endpoint, bucket)} - {"COMMITTED", committed}
    assert len(partial) == 1  # the killed save's version: written, never committed
    _check(ldc.load(_template(), url), 1)
    with pytest.raises(IncompleteCheckpointError, match="no commit marker"):
        ldc.load(_template(), f"{url}/{partial.pop()}")


def _rank_1_without_credentials(rank, world, url):
    if rank == 1:
        del os.environ["AWS_ACCESS_KEY_ID"]
    try:
        ldc.save(_state(1, rank, world), url)
    except CheckpointingError as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def test_credentials_missing_on_one_rank_fail_the_save_on_every_rank(bucket, endpoint):
    url = f"s3://{bucket}/ck"
    for msg in run_distributed(_rank_1_without_credentials, 2, url):
        assert msg.startswith("SaveFailedError") and "rank 1" in msg and "without credentials" in msg, msg
    assert _keys(endpoint, bucket) == []  # rank 0's version removed, nothing committed


def _unreachable_then_denied(rank, world, url, unreachable):
    """Save and load with the endpoint moved to where nothing listens, then at the server (which
    checks keys: ours are unknown); each failure as this rank saw it."""
    found = {}
    for case, where in (("unreachable", unreachable), ("denied", os.environ["AWS_ENDPOINT_URL"])):
        os.environ["AWS_ENDPOINT_URL"] = where
        for call in (lambda: ldc.save(_state(1, rank, world), url), lambda: ldc.load(_template(rank, world), url)):
            try:
                call()
                found.setdefault(case, []).append("no error")
            except CheckpointingError as e:
                found.setdefault(case, []).append(f"{type(e).__name__}: {e}")
    return found


def test_unreachable_endpoint_and_denied_access_fail_every_rank_in_one_line(bucket, monkeypatch):
    from moto import settings

    url = f"s3://{bucket}/ck"
    monkeypatch.setattr(settings, "INITIAL_NO_AUTH_ACTION_COUNT", 0)  # the server now checks keys
    for found in run_distributed(_unreachable_then_denied, 2, url, f"http://127.0.0.1:{free_port()}"):
        for case, why in (("unreachable", "is unreachable"), ("denied", "access denied")):
            assert len(found[case]) == 2, found
            for text in found[case]:
                assert why in text and url in text and "\n" not in text, text
