"""Every tensorstore context of ours shares the process's executors (storage/ts_context.py): tensorstore
frees a context's own executor racily (a double free / SIGSEGV in its thread pool), so none may die
with a context."""

import numpy as np
import pytest
import tensorstore as ts

import lightning_distckpt as ldc
from lightning_distckpt.storage.local_store import LocalStore
from lightning_distckpt.storage.s3_store import S3Store
from lightning_distckpt.storage.ts_context import EXECUTORS, child_context

SPEC = {"file_io_concurrency": {"limit": 3}, "data_copy_concurrency": {"limit": 3},
        "cache_pool": {"total_bytes_limit": 0}, "file_io_sync": False}


def test_children_share_the_executors_and_keep_the_rest_their_own():
    a, b = child_context(SPEC), child_context(dict(SPEC))
    for name in EXECUTORS:
        assert a[name] == b[name]  # the same resource (== is identity for resources)
        assert a[name].to_json() == {"limit": 3}
    assert a["cache_pool"] != b["cache_pool"]  # nothing cached is shared between readers and writers
    assert a["file_io_sync"].to_json() is False


def test_other_limits_or_none_get_executors_of_their_own_kept_alike():
    other = child_context({**SPEC, "data_copy_concurrency": {"limit": 5}})
    assert other["data_copy_concurrency"].to_json() == {"limit": 5}
    assert other["data_copy_concurrency"] != child_context(SPEC)["data_copy_concurrency"]
    assert other["data_copy_concurrency"] == child_context({**SPEC, "data_copy_concurrency": {"limit": 5}})[
        "data_copy_concurrency"]
    assert child_context({})["file_io_concurrency"] == child_context({"cache_pool": {}})["file_io_concurrency"]


@pytest.mark.parametrize("store", ["local", "s3"])
def test_the_stores_contexts_share_them(tmp_path, store):
    options = ldc.StorageOptions(io_concurrency=6)
    s = LocalStore(str(tmp_path / "ck")) if store == "local" else S3Store("s3://bucket/ck", options)
    first, second = s.ts_context(options), s.ts_context(options)
    assert first is not second
    assert first["data_copy_concurrency"] == second["data_copy_concurrency"]
    assert first["data_copy_concurrency"].to_json() == {"limit": 6}


def test_a_child_reads_and_writes_through_the_shared_executors(tmp_path):
    """Many contexts made and dropped, each writing and reading an array: every value as written."""
    data = np.arange(64, dtype=np.float32)
    for i in range(20):
        ctx = child_context(SPEC)
        arr = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(tmp_path / f"a{i}")},
                       "metadata": {"shape": [64], "data_type": "float32"}}, create=True, context=ctx).result()
        arr.write(data + i).result()
        np.testing.assert_array_equal(arr.read().result(), data + i)
