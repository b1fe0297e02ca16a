"""Chunk files written with O_DIRECT (storage/direct_write.py): the same bytes tensorstore writes
(plain chunks, the edge chunk padded with zeros), from aligned and unaligned memory, any size; a
file system that refuses O_DIRECT is written buffered; an existing file is never overwritten."""

import json
import os

import numpy as np
import pytest
import torch

import lightning_distckpt as ldc
from lightning_distckpt.saving.async_staging import StagingPool, plan_staging
from lightning_distckpt.storage import direct_write
from lightning_distckpt.storage.base import ShardWrite
from lightning_distckpt.storage.options import StorageOptions

needs_direct = pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="O_DIRECT is Linux's")


def _direct_dir(tmp_path):
    if not direct_write.supported(str(tmp_path)):
        pytest.skip(f"{tmp_path}'s file system refuses O_DIRECT")  # CI's /tmp allows it (ext4, xfs)
    return tmp_path


@needs_direct
@pytest.mark.parametrize("nbytes,size,offset", [
    (8 << 20, 8 << 20, 0),  # aligned source, whole blocks: written without a copy
    (8 << 20, 8 << 20, 64),  # unaligned source: through the bounce buffer
    ((8 << 20) + 4096 * 3 + 17, (8 << 20) + 4096 * 3 + 17, 0),  # an odd tail after aligned blocks
    (5 * 1000 + 3, 4096 * 3 + 5, 8),  # zarr's edge chunk: data, then zeros up to the chunk's size
    (0, 4096, 0),  # nothing but padding
])
def test_chunk_file_holds_the_bytes_then_zeros(tmp_path, nbytes, size, offset):
    root = _direct_dir(tmp_path)
    raw = np.frombuffer(np.random.default_rng(0).bytes(nbytes + 2 * 4096), dtype=np.uint8)
    shift = -raw.ctypes.data % 4096 + offset
    src = raw[shift:shift + nbytes]
    path = str(root / "chunk")
    direct_write.write_chunk_file(path, src, size)
    assert open(path, "rb").read() == src.tobytes() + bytes(size - nbytes)


@needs_direct
def test_an_existing_file_is_never_overwritten(tmp_path):
    root = _direct_dir(tmp_path)
    (root / "chunk").write_bytes(b"theirs")
    os.symlink(root / "elsewhere", root / "link")
    with pytest.raises(FileExistsError):
        direct_write.write_chunk_file(str(root / "chunk"), np.zeros(4096, np.uint8), 4096)
    with pytest.raises(FileExistsError):  # O_EXCL: a planted link is not followed
        direct_write.write_chunk_file(str(root / "link"), np.zeros(4096, np.uint8), 4096)
    assert (root / "chunk").read_bytes() == b"theirs" and not (root / "elsewhere").exists()


def _state():
    g = torch.Generator().manual_seed(0)
    return {"a": torch.randn(1000, 333, generator=g),  # 1.3 MB: one chunk, not a multiple of a block
            "b": torch.randn(3_000_001, generator=g),  # several chunks at 1 MiB, an edge chunk
            "small": torch.randn(5, generator=g),  # packed
            "d": torch.randn(700, 1000, generator=g, dtype=torch.float64),
            "e": torch.randint(0, 100, (2_000_000,), generator=g, dtype=torch.int16)}


def _files(root):
    """The files of the rank stores, each save's token (in every zarr.json) made the same."""
    token = json.load(open(os.path.join(root, "metadata.json")))["save_token"].encode()
    out = {}
    for d, _, names in os.walk(root):
        for n in names:
            p = os.path.join(d, n)
            if "/data/" in p:
                out[os.path.relpath(p, root)] = open(p, "rb").read().replace(token, b"<token>")
    return out


@needs_direct
@pytest.mark.parametrize("chunk_bytes", [64 << 20, 1 << 20, 999_999])
def test_zarr_checkpoints_are_bit_identical_with_and_without(tmp_path, monkeypatch, chunk_bytes):
    _direct_dir(tmp_path)
    sd = _state()
    paths = {}
    for direct in ("0", "1"):
        monkeypatch.setenv(direct_write.DIRECT_WRITES_ENV, direct)
        paths[direct] = str(tmp_path / f"ck{direct}")
        ldc.save(sd, paths[direct], storage=StorageOptions(layout="zarr", chunk_bytes=chunk_bytes))
    buffered, direct = _files(paths["0"]), _files(paths["1"])
    assert buffered.keys() == direct.keys() and all(buffered[k] == direct[k] for k in buffered)
    template = {k: torch.empty_like(v) for k, v in sd.items()}
    out = ldc.load(template, paths["1"])
    assert all(torch.equal(out[k], sd[k]) for k in sd)
    assert ldc.validate(paths["1"]).ok


@needs_direct
def test_async_save_writes_from_the_page_aligned_pool(tmp_path):
    _direct_dir(tmp_path)
    shards = [ShardWrite("w", 0, torch.randn(600, 1000)), ShardWrite("tiny", 0, torch.randn(3)),
              ShardWrite("v", 0, torch.randn(300_001))]
    pool = StagingPool()
    plan = plan_staging(shards, None)
    pool.prepare(plan)
    for s in pool.stage(plan.staged):
        if s.data.nbytes >= 1 << 20:
            assert s.data.data_ptr() % 4096 == 0, s.key
    sd = _state()
    path = str(tmp_path / "ck")
    saver = ldc.AsyncSaver()
    saver.save({k: ldc.ShardedTensor.from_rank_offsets(k, v.clone()) for k, v in sd.items()}, path,
               storage=StorageOptions(layout="zarr", chunk_bytes=1 << 20)).finalize()
    template = {k: ldc.ShardedTensor.from_rank_offsets(k, torch.empty_like(v)) for k, v in sd.items()}
    out = ldc.load(template, path)
    assert all(torch.equal(out[k], sd[k]) for k in sd)


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no tmpfs at /dev/shm")
def test_tmpfs_checkpoints_load_back(tmp_path_factory):
    # tmpfs takes O_DIRECT from Linux 6.6 and refuses it before: either way the bytes land
    import shutil
    import tempfile

    root = tempfile.mkdtemp(dir="/dev/shm")
    try:
        sd = _state()
        ldc.save(sd, os.path.join(root, "ck"), storage=StorageOptions(layout="zarr", chunk_bytes=1 << 20))
        out = ldc.load({k: torch.empty_like(v) for k, v in sd.items()}, os.path.join(root, "ck"))
        assert all(torch.equal(out[k], sd[k]) for k in sd)
    finally:
        shutil.rmtree(root)


def test_direct_writes_must_be_a_bool():
    with pytest.raises(ldc.ConfigError, match="direct_writes"):
        StorageOptions(direct_writes="yes")


@needs_direct
def test_a_forked_child_writes_with_threads_of_its_own(tmp_path):
    # the parent's writer threads do not exist in a forked child: it must not wait for them
    import multiprocessing

    _direct_dir(tmp_path)
    arr = np.arange(1 << 18, dtype=np.float32).reshape(256, 1024)
    direct_write.submit_array(str(tmp_path / "parent"), arr, 64).result()  # the parent's pool exists
    ctx = multiprocessing.get_context("fork")
    child = ctx.Process(target=lambda: direct_write.submit_array(str(tmp_path / "child"), arr, 64).result())
    child.start()
    child.join(60)  # a failure bound only: the write takes milliseconds
    assert child.exitcode == 0
    for name in ("parent", "child"):
        got = b"".join((tmp_path / name / "c" / str(i) / "0").read_bytes() for i in range(4))
        assert got == arr.tobytes()
