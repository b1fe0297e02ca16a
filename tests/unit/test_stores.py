"""Every store runs the same save / load / validate / clean / remove / convert paths: the local
file system and the in-memory store of ``tests/memory_store.py``, which plugs in as one class and
one registration (``register_store``). S3 runs them against moto in ``tests/s3/test_s3*.py``."""

from __future__ import annotations

import uuid
from typing import Iterator

import pytest
import torch

import lightning_distckpt as ldc
from lightning_distckpt.cli.clean import clean
from lightning_distckpt.comm import Comm
from lightning_distckpt.convert import relayout_checkpoint
from lightning_distckpt.core.errors import CheckpointingError, IncompleteCheckpointError
from lightning_distckpt.lightning.checkpoint_io import DistCheckpointIO
from lightning_distckpt.saving.save import prepare_save, write_local
from lightning_distckpt.storage.local_store import LocalStore
from lightning_distckpt.storage.options import StorageOptions
from lightning_distckpt.storage.staging import remove_owner_notes
from lightning_distckpt.storage.stores import STORES, open_store, register_store, unregister_store
from lightning_distckpt.validation import validate
from memory_store import MemoryStore


@pytest.fixture
def memory_store() -> Iterator[None]:
    register_store(MemoryStore)  # the one line a new store needs
    yield
    unregister_store(MemoryStore)


@pytest.fixture(params=["local", "memory"])
def location(request, tmp_path, memory_store) -> str:
    return str(tmp_path / "ck") if request.param == "local" else f"memory://ck-{uuid.uuid4().hex[:8]}"


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": ldc.ShardedTensor.from_rank_offsets("w", torch.randn(64, 8, generator=g)),
        "bias": ldc.ShardedTensor.from_rank_offsets("bias", torch.randn(8, generator=g)),  # packed (small)
        "obj": ldc.ShardedObject("obj", {"seed": seed}, (1,), (0,)),
        "step": seed,
    }


def _template() -> dict:
    return {"w": ldc.ShardedTensor.from_rank_offsets("w", torch.empty(64, 8)),
            "bias": ldc.ShardedTensor.from_rank_offsets("bias", torch.empty(8)),
            "obj": ldc.ShardedObject("obj", None, (1,), (0,))}


def _check(loaded: dict, seed: int) -> None:
    want = _state(seed)
    assert torch.equal(loaded["w"], want["w"].data) and torch.equal(loaded["bias"], want["bias"].data)
    assert loaded["obj"] == {"seed": seed} and loaded["step"] == seed


def test_the_factory_picks_the_store_by_the_location(tmp_path, memory_store):
    assert type(open_store(str(tmp_path))) is LocalStore
    assert type(open_store("memory://a/")) is MemoryStore and open_store("memory://a/").location == "memory://a"
    unregister_store(MemoryStore)
    with pytest.raises(ldc.ArgumentError, match="memory:// URLs are not supported"):
        open_store("memory://a")  # no store serves it: refused by name, never a local folder "memory:"


@pytest.mark.parametrize("layout", ["ocdbt", "zarr"])
def test_save_load_validate_in_every_store(location, layout):
    ldc.save(_state(1), location, storage=StorageOptions(layout=layout))
    _check(ldc.load(_template(), location), 1)
    ldc.save(_state(2), location)  # replaces the committed checkpoint
    _check(ldc.load(_template(), location), 2)
    report = validate(location)
    assert report.ok and report.shards == 2 and report.objects == 1, report.problems


def test_a_failed_save_leaves_the_previous_checkpoint_and_clean_removes_what_it_left(location):
    ldc.save(_state(1), location)
    prep = prepare_save(_state(2), location, Comm(None, 0, 1))
    write_local(prep)  # killed before its commit: the staging location stays behind
    if isinstance(prep.store, LocalStore):  # and its process is gone: no owner note names a live writer
        remove_owner_notes(prep.staging)
    _check(ldc.load(_template(), location), 1)
    kept = clean(location, older_than_s=3600, dry_run=False)
    assert [a.action for a in kept] == ["kept"], kept
    planned = clean(location, older_than_s=0, dry_run=True)
    assert [(a.action, a.leftover.path) for a in planned] == [("would remove", prep.staging)]
    done = clean(location, older_than_s=0, dry_run=False)
    assert [a.action for a in done] == ["removed"] and clean(location, 0, dry_run=True) == []
    _check(ldc.load(_template(), location), 1)


def test_remove_is_modelcheckpoints_top_k_removal(location):
    ldc.save(_state(1), location)
    assert open_store(location).exists()
    DistCheckpointIO().remove_checkpoint(location)
    assert not open_store(location).exists()
    with pytest.raises(CheckpointingError):
        ldc.load(_template(), location)


def test_relayout_copies_between_stores(tmp_path, memory_store):
    mem, local = f"memory://src-{uuid.uuid4().hex[:8]}", str(tmp_path / "copy")
    ldc.save(_state(3), mem)
    relayout_checkpoint(mem, local, StorageOptions(layout="zarr"))
    _check(ldc.load(_template(), local), 3)
    back = f"memory://back-{uuid.uuid4().hex[:8]}"
    relayout_checkpoint(local, back, StorageOptions())
    _check(ldc.load(_template(), back), 3)
    assert validate(back).ok


def test_a_location_without_a_commit_is_no_checkpoint(location):
    with pytest.raises((IncompleteCheckpointError, ldc.CheckpointNotFoundError)):
        ldc.load(_template(), location)


def test_a_store_the_caller_made_is_saved_to_and_loaded_from_unregistered():
    # as DCP's storage_writer: no registration, no URL lookup; the store's own options are the save's
    store = MemoryStore(MemoryStore.normalize(f"memory://own-{uuid.uuid4().hex[:8]}", "test"),
                        StorageOptions(layout="zarr"))
    ldc.save(_state(3), store)
    _check(ldc.load(_template(), store), 3)
    assert ldc.load_common_state_dict(store)["step"] == 3
    assert store.open_metadata().meta["storage"]["layout"] == "zarr"
    with pytest.raises(ldc.ArgumentError, match="storage= differs from the store's own options"):
        ldc.save(_state(4), store, storage=StorageOptions(layout="ocdbt"))
    _check(ldc.load(_template(), store), 3)  # the refused save wrote nothing
    ldc.save(_state(4), store, storage=StorageOptions(layout="zarr"))  # the same options: fine
    _check(ldc.load(_template(), store), 4)


def test_an_async_saver_applies_its_writer_choices_to_a_copy_of_the_callers_store(tmp_path):
    store = LocalStore(LocalStore.normalize(str(tmp_path / "ck"), "test"))
    saver = ldc.AsyncSaver(io_concurrency=1)
    request = saver.save(_state(5), store)
    request.finalize()
    assert request.store is not store and request.store.options.io_concurrency == 1
    assert store.options == StorageOptions()  # the caller's store keeps its own
    _check(ldc.load(_template(), str(tmp_path / "ck")), 5)
    request = ldc.AsyncSaver().save(_state(6), store)
    request.finalize()
    assert request.store is store  # no choices of the saver's own: the caller's store itself
    _check(ldc.load(_template(), store), 6)


def test_a_store_without_a_scheme_is_refused_by_registration_with_the_way_to_pass_it():
    from lightning_distckpt.core.errors import ArgumentError

    class NoScheme(MemoryStore):
        scheme = ""

    with pytest.raises(ArgumentError, match=r"NoScheme: a registered store needs a URL scheme .* save\(state, store\)"):
        register_store(NoScheme)
    assert NoScheme not in STORES
