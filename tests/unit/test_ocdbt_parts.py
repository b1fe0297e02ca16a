"""An OCDBT store on a local file system is written in parts of about PART_BYTES, one commit each,
and each part's files leave the page cache once durable (storage/page_cache.py): the checkpoint
reads back exactly (large arrays, packed small ones, objects), none of its data files stays cached,
and with direct writes off (or a state of one part) it is one commit, cached as the kernel likes."""

import ctypes
import mmap
import os

import pytest
import torch

import lightning_distckpt as ldc
from lightning_distckpt.storage import commit, direct_write
from lightning_distckpt.storage.tensorstore_write import PART_BYTES

needs_linux = pytest.mark.skipif(not hasattr(os, "posix_fadvise") or not hasattr(os, "O_DIRECT"),
                                 reason="posix_fadvise and O_DIRECT are Linux's")
_libc = ctypes.CDLL(None, use_errno=True)


def _cached_pages(path):
    """Pages of ``path`` in the page cache (mincore over a private read mapping, nothing touched)."""
    size = os.path.getsize(path)
    if size == 0:
        return 0
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
    try:
        pages = -(-size // mmap.PAGESIZE)
        vec = (ctypes.c_ubyte * pages)()
        addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
        if _libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(size), vec) != 0:
            raise OSError(ctypes.get_errno(), "mincore")
        return sum(v & 1 for v in vec)
    finally:
        del addr
        m.close()


def _state(template=False):
    g = torch.Generator().manual_seed(1)
    big = [torch.randn(PART_BYTES // 4 // 2, generator=g) for _ in range(5)]  # half a part each
    sd = {f"big{i}": t for i, t in enumerate(big)}
    sd["small"] = torch.randn(7, generator=g)  # packed
    if template:
        sd = {k: torch.zeros_like(v) for k, v in sd.items()}
    out = {k: ldc.ShardedTensor.from_rank_offsets(k, v) for k, v in sd.items()}
    out["obj"] = ldc.ShardedObject("obj", None if template else {"a": 1}, (1,), (0,))
    return out


def _data_files(ckpt):
    return [os.path.join(d, f) for d, _, fs in os.walk(os.path.join(ckpt, "data")) for f in fs]


def _versions(ckpt):
    import tensorstore as ts

    base = {"driver": "file", "path": os.path.join(ckpt, "data", "rank_00000") + "/"}
    return len(ts.ocdbt.dump(ts.KvStore.open(base).result()).result()["versions"])


@needs_linux
@pytest.mark.parametrize("direct", ["1", "0"])
def test_a_large_store_is_written_in_parts_and_leaves_the_cache(tmp_path, monkeypatch, direct):
    if not direct_write.supported(str(tmp_path)):
        pytest.skip(f"{tmp_path}'s file system has no page cache to skip (tmpfs)")  # CI's /tmp is ext4
    monkeypatch.setenv(direct_write.DIRECT_WRITES_ENV, direct)
    ckpt = str(tmp_path / "ckpt")
    ldc.save(_state(), ckpt)
    out = ldc.load(_state(template=True), ckpt)
    expected = _state()
    for k, v in expected.items():
        assert (out[k] == v.data) if k == "obj" else torch.equal(out[k], v.data), k
    if direct == "1":
        assert _versions(ckpt) == 3  # parts: the packed shards and two halves, two halves, one half
        # the load just read the files back into the cache: look at a second save's instead
        again = str(tmp_path / "again")
        ldc.save(_state(), again)
        files = _data_files(again)
        assert sum(os.path.getsize(f) for f in files) > 2 * PART_BYTES
        # what stays: the few pages each later commit reads back (the manifest, B+tree nodes)
        cached = {os.path.relpath(f, again): _cached_pages(f) for f in files}
        assert sum(cached.values()) * mmap.PAGESIZE <= 64 * 1024, cached
    else:
        assert _versions(ckpt) == 1  # one commit, as before


@needs_linux
def test_each_part_syncs_only_what_it_wrote(tmp_path, monkeypatch):
    """A part's commit adds a data file no later commit changes: each data file is fsync'd once, by
    its own part, not again at every later part (n parts took n * n / 2 fsyncs); the manifest and
    the directories, which each commit changes, at every part."""
    if not direct_write.supported(str(tmp_path)):
        pytest.skip(f"{tmp_path}'s file system has no page cache to skip (tmpfs)")
    monkeypatch.setenv(direct_write.DIRECT_WRITES_ENV, "1")
    synced = []
    real = commit.fsync_all
    monkeypatch.setattr(commit, "fsync_all", lambda paths: (synced.extend(paths), real(paths))[1])
    ckpt = str(tmp_path / "ckpt")
    ldc.save(_state(), ckpt)
    data = [p for p in synced if os.sep + "d" + os.sep in p and "rank_00000" in p]
    assert _versions(ckpt) == 3 and len(data) == len(set(data)) == 3, data  # one data file per part, once each
    manifests = [p for p in synced if p.endswith("manifest.ocdbt")]
    assert len(manifests) == 3, manifests
    out = ldc.load(_state(template=True), ckpt)
    assert torch.equal(out["big0"], _state()["big0"].data)
