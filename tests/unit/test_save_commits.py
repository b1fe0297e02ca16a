"""What one save costs the store (issue 29): each rank store gets one OCDBT commit per write call (one
version in its manifest; no empty first one: the writer tells OCDBT its configuration), several calls into one store (an async
save's waves) are each committed, and the commit's directory walk leaves out the rank stores,
which their writers made durable."""

import os

import pytest
import tensorstore as ts
import torch

import lightning_distckpt as ldc
from lightning_distckpt.storage import commit as commit_mod
from lightning_distckpt.storage.base import ObjectWrite, ShardWrite
from lightning_distckpt.storage.layout import object_path, rank_dir, tensor_path
from lightning_distckpt.storage.tensorstore_io import TensorStoreIO


def _versions(checkpoint: str, writer: int = 0) -> int:
    """How many versions (commits) the OCDBT manifest of ``writer``'s store records."""
    base = ts.KvStore.open({"driver": "file", "path": rank_dir(checkpoint, writer) + "/"}).result()
    return len(ts.ocdbt.dump(base).result()["versions"])


def _state():
    """Large shards (each its own array), small ones (packed, two dtypes) and an object."""
    g = torch.Generator().manual_seed(0)
    sd = {f"big{i}": ldc.ShardedTensor.from_rank_offsets(f"big{i}", torch.randn(70000, generator=g)) for i in range(3)}
    sd.update({f"norm{i}": ldc.ShardedTensor.from_rank_offsets(f"norm{i}", torch.randn(16, generator=g))
               for i in range(50)})
    sd["half"] = ldc.ShardedTensor.from_rank_offsets("half", torch.randn(8, generator=g).to(torch.bfloat16))
    sd["rng"] = ldc.ShardedObject("rng", {"seed": 3}, (1,), (0,))
    return sd


def test_a_save_commits_each_rank_store_once(tmp_path):
    sd = _state()
    ldc.save(sd, str(tmp_path / "ck"))
    # before issue 29 a save like this one made four: an empty manifest when the store was created,
    # then the arrays, the zarr.json files and the objects as they happened to arrive
    assert _versions(str(tmp_path / "ck")) == 1
    back = ldc.load(_state(), str(tmp_path / "ck"))
    for key, value in sd.items():
        if key == "rng":
            assert back[key] == {"seed": 3}
        else:
            assert torch.equal(back[key], value.data)


def test_several_writes_into_one_store_are_each_committed(tmp_path):
    """An async save under a memory budget writes a rank's shards in waves: one call each."""
    root = str(tmp_path / "ck")
    os.makedirs(root)
    io = TensorStoreIO(root)
    a, b = torch.arange(1000.0), torch.arange(500.0) * -1
    io.write(0, [ShardWrite("a", 0, a, None)])
    io.write(0, [ShardWrite("b", 0, b, None)], [ObjectWrite("o", 0, b"payload")])
    assert _versions(root) == 2
    for key, value in (("a", a), ("b", b)):
        stored = ts.open(io.array_spec(0, tensor_path(key, 0))).result().read().result()
        assert torch.equal(torch.from_numpy(stored), value)
    kv = ts.KvStore.open(io.kvstore_spec(0)).result()
    assert kv.read(object_path("o", 0)).result().state == "value"


def test_a_failed_write_commits_nothing(tmp_path):
    """A write that fails (a shard that cannot be stored) leaves no version behind: the transaction
    is aborted, not half committed."""
    root = str(tmp_path / "ck")
    os.makedirs(root)
    io = TensorStoreIO(root)
    io.write(0, [ShardWrite("a", 0, torch.arange(10.0), None)])
    with pytest.raises(ldc.CheckpointingError, match="writing failed|cannot create"):
        # the same array again: its zarr.json exists, so creating it fails
        io.write(0, [ShardWrite("a", 0, torch.arange(10.0), None), ShardWrite("c", 0, torch.arange(3.0), None)])
    assert _versions(root) == 1


def test_the_commit_walk_leaves_the_rank_stores_to_their_writers(tmp_path, monkeypatch):
    """Rank 0's commit fsyncs the staging directory's own entries, not every directory of every
    rank's store (each writer fsync'd its own before reporting success); a save's own entries are
    made durable beside its shards (after metadata.json), so the commit syncs the staging directory
    once, after its marker."""
    synced, commits = [], []
    real, real_commit = commit_mod.fsync_dir, commit_mod.commit
    monkeypatch.setattr(commit_mod, "fsync_dir", lambda path: (synced.append(os.path.abspath(path)), real(path)))
    monkeypatch.setattr(commit_mod, "commit",
                        lambda *a, **k: (commits.append(len(synced)), real_commit(*a, **k)))
    ldc.save(_state(), str(tmp_path / "ck"))
    staged = [p for p in synced if os.path.basename(p).startswith(".distckpt-staging-")]
    assert len(staged) == 2  # beside the shards (metadata.json, common.pt, data/) and after the marker
    in_commit = synced[commits[0]:]  # not one directory of a rank store
    assert len(in_commit) == 2 and os.path.basename(in_commit[0]).startswith(".distckpt-staging-"), in_commit
    assert synced[-1] == str(tmp_path)  # the parent, after the rename


def test_a_commit_not_told_its_entries_are_durable_syncs_them(tmp_path, monkeypatch):
    """A commit whose metadata.json was not written by the save (relayout, tiers) or whose store
    did not see the save's blobs fsyncs the staging directory before its marker, as before."""
    from lightning_distckpt.storage.local_store import LocalStore

    synced = []
    real = commit_mod.fsync_dir
    monkeypatch.setattr(commit_mod, "fsync_dir", lambda path: (synced.append(os.path.abspath(path)), real(path)))
    monkeypatch.setattr(LocalStore, "write_blob", lambda self, staging, name, data: commit_mod.write_file_durable(
        os.path.join(staging, name), data))  # a store that syncs nothing beside the shards
    ldc.save(_state(), str(tmp_path / "ck"))
    staged = [p for p in synced if os.path.basename(p).startswith(".distckpt-staging-")]
    assert len(staged) == 2  # before the marker and after it
    assert ldc.load(_state(), str(tmp_path / "ck"))["norm3"].shape == (16,)


@pytest.mark.parametrize("layout", ["ocdbt", "zarr"])
def test_a_rank_store_is_made_durable_after_its_commit(tmp_path, monkeypatch, layout):
    """tensorstore writes a rank store unsynced (an OCDBT commit would fsync file, directory,
    manifest, directory one after another; a zarr one each file in turn); the writer then fsyncs
    every file and directory of it."""
    from lightning_distckpt.storage.local_store import LocalStore
    from lightning_distckpt.storage.options import StorageOptions

    options = StorageOptions(layout=layout, chunk_bytes=100_000)  # zarr: big1's chunks, 2 files
    assert LocalStore(str(tmp_path)).ts_context(options).spec.to_json()["file_io_sync"] is False
    synced = []
    real_dir = commit_mod.fsync_dir  # files and directories alike
    monkeypatch.setattr(commit_mod, "fsync_dir", lambda path: (synced.append(path), real_dir(path)))
    ldc.save(_state(), str(tmp_path / "ck"), storage=options)
    store = rank_dir(str(tmp_path / "ck"), 0)
    on_disk = {os.path.relpath(os.path.join(d, n), store) for d, dirs, files in os.walk(store) for n in dirs + files}
    on_disk.add(".")
    in_store = {os.path.relpath(p, rank_dir(p.split("/data/rank_00000")[0], 0))
                for p in synced if "/data/rank_00000" in p}
    assert on_disk and on_disk <= in_store, on_disk - in_store
    assert torch.equal(ldc.load(_state(), str(tmp_path / "ck"))["big1"], _state()["big1"].data)


def test_fsync_all_syncs_every_path_and_raises_what_any_thread_met(tmp_path, monkeypatch):
    """fsync_all: every path fsync'd once (helper threads of the kept pool and the caller share them),
    a failure on any thread raised by the caller; with the pool refusing work (the interpreter
    shutting down: an async save finished at exit) the caller does them all itself."""
    paths = []
    for i in range(6):
        (tmp_path / f"f{i}").write_bytes(b"x" * 100)
        paths.append(str(tmp_path / f"f{i}"))
    paths.append(str(tmp_path))
    synced = []
    real = commit_mod.fsync_dir
    monkeypatch.setattr(commit_mod, "fsync_dir", lambda path: (synced.append(path), real(path)))
    commit_mod.fsync_all(paths)
    assert sorted(synced) == sorted(paths)
    with pytest.raises(FileNotFoundError):
        commit_mod.fsync_all(paths + [str(tmp_path / "missing")])
    class Stopped:  # as the kept pool at interpreter shutdown
        def submit(self, fn):
            return None

    monkeypatch.setattr(commit_mod, "_SYNC_POOL", Stopped())
    synced.clear()
    commit_mod.fsync_all(paths)
    assert sorted(synced) == sorted(paths)


def test_a_blob_that_cannot_be_written_fails_the_save(tmp_path, monkeypatch):
    """common.pt and metadata.json are written beside the shards (on a kept thread): a failure there
    (a full disk) fails the save with its error, and the previous checkpoint stays."""
    import errno

    from lightning_distckpt.storage.local_store import LocalStore

    ldc.save(_state(), str(tmp_path / "ck"))
    real = LocalStore.write_blob

    def full(self, staging, name, data):
        if name == "metadata.json":
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, staging, name, data)

    monkeypatch.setattr(LocalStore, "write_blob", full)
    with pytest.raises(ldc.SaveFailedError, match="No space left on device"):
        ldc.save(_state(), str(tmp_path / "ck"))
    assert sorted(os.listdir(tmp_path)) == ["ck"]  # the staging directory discarded
    assert ldc.load(_state(), str(tmp_path / "ck"))["norm3"].shape == (16,)
