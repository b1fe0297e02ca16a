"""Third-party stores, round 3: what the two earlier rounds (test_trust_store_plugin_redteam.py, the save side,
and test_trust_store_plugin_load_redteam.py, the load side) left. Each found with a real 1- or 2-process run.

What a red-team probe found (each on the old code):

* A store whose ``commit`` returns without committing (or commits other, older metadata) was taken at its word:
  the save reported success on every rank, a load then gave the previous checkpoint's values (or failed on a
  token mismatch), and ModelCheckpoint's ``last`` link pointed at a checkpoint that was never there. Now, after a
  third party's ``commit`` returns, rank 0 asks the store's ``open_metadata`` for the checkpoint's save token:
  another one (or none) is a SaveFailedError on every rank naming the store and the commit. The built-in stores'
  commits check themselves and are not asked again (no cost for them).
* A third party's ``check_target``, ``new_staging``, ``begin``, ``write_blob``, ``commit`` or ``make_durable``
  raising: agreed by every rank, but said only ``rank 1: OSError: begin broke``: not which store, nor which call.
  Now ``_Named('/x/ck').begin('/x/.ck.staging-..', 1) failed: OSError: begin broke`` (``storage/store.called``;
  a blob or metadata.json shown by its size).
* ``reserve`` raising (``AsyncSaver(reserve_targets=True)``, rank 0): rank 0 raised alone out of
  ``AsyncSaver.save`` while rank 1 waited for its commit (CollectiveError at the group's timeout). Now a WARNING
  naming the store; the save goes on. ``release`` likewise.
* A load that one rank cannot open: rank 0 said ``load from /x/ck failed``, rank 1 ``load from the checkpoint
  failed``. Now every rank names the place asked for.
* ``still_committed`` raising a BaseException that is no Exception (asyncio's CancelledError) on one rank, after
  a read failed there: raised on that rank alone, out of the load's agreement; its peer waited. Now a WARNING
  naming the store, and the read's own error stands on every rank. (An Exception was already handled so, untested.)

Hang guards: the group times out after ``GROUP_TIMEOUT_S``; a rank left waiting gets a CollectiveError, told
apart from the agreed error, and a scenario list stops at the first outcome not agreed. Nothing waits on time.
"""

from __future__ import annotations

import logging
import os
import shutil
import uuid

import pytest
import torch

import lightning_distckpt as ldc
from dist_utils import run_distributed
from lightning_distckpt.comm import get_comm
from lightning_distckpt.core.errors import CheckpointingError
from lightning_distckpt.storage.local_store import LocalStore
from memory_store import _BLOBS, MemoryStore
from trust.test_trust_load_one_rank_fails_redteam import _in_step
from trust.test_trust_store_plugin_load_redteam import _outcome  # a BaseException on one rank: "unagreed"

GROUP_TIMEOUT_S = 30  # a rank left waiting gets a CollectiveError, told apart from the agreed error


class _Cancelled(BaseException):
    """Not an Exception, as asyncio's CancelledError: a store using asyncio may raise it."""


_ERRORS = {"RuntimeError": RuntimeError, "OSError": OSError, "KeyError": KeyError, "ValueError": ValueError,
           "TimeoutError": TimeoutError, "Base": _Cancelled}


def _state(rank, world, value):
    return {"w": ldc.ShardedTensor.from_rank_offsets("w", torch.full((4, 3), float(value)), (0, rank, world)),
            "step": value}


def _template(rank, world):
    return {"w": ldc.ShardedTensor.from_rank_offsets("w", torch.zeros(4, 3), (0, rank, world))}


def _loaded(store, rank=0, world=1):
    template = _template(rank, world)
    step = ldc.load(template, store)["step"]
    assert torch.equal(template["w"].data, torch.full((4, 3), float(step)))
    return step


# -- 1. a commit that returns without committing -------------------------------------------------------------
class _MemoryLiar(MemoryStore):
    """``lie``: "noop" returns without committing; "older" commits the first save's metadata.json instead."""

    lie = None
    first = None

    def commit(self, staging, metadata_json, marker):
        self.first = self.first or metadata_json
        if self.lie == "noop":
            return
        super().commit(staging, self.first if self.lie == "older" else metadata_json, marker)


@pytest.mark.parametrize("lie", ["noop", "older"])
def test_a_commit_that_did_not_commit_fails_the_save_naming_the_store(lie):
    store = _MemoryLiar(MemoryStore.normalize(f"memory://liar-{uuid.uuid4().hex[:8]}", "test"))
    ldc.save(_state(0, 1, 1), store)
    store.lie = lie
    with pytest.raises(ldc.SaveFailedError, match=r"commit failed, nothing was committed: rank 0:"
                                                  r" _MemoryLiar\('memory://liar-.*'\)\.commit\(.*\) returned, but the "
                                                  r"checkpoint the store holds now is not this save's"):
        ldc.save(_state(0, 1, 2), store)  # the old code: returned as saved
    store.lie = None
    if lie == "noop":  # the previous checkpoint stays; the failed save's staging is left to `clean` (the store
        assert _loaded(store) == 1 and len(store.find_leftovers()) == 1  # may have committed it: not discarded)
    ldc.save(_state(0, 1, 3), store)
    assert _loaded(store) == 3


def test_a_relayout_through_a_commit_that_did_not_commit_fails_naming_the_store(tmp_path):
    """``convert``'s relayout commits through the destination's store as a save does: a registered third-party
    store whose commit returns without committing is refused there too (the old code reported it copied)."""
    from lightning_distckpt.convert import relayout_checkpoint
    from lightning_distckpt.storage.stores import register_store, unregister_store

    class NoopCommit(_MemoryLiar):
        lie = "noop"

    source = str(tmp_path / "src")
    ldc.save(_state(0, 1, 5), source)
    register_store(NoopCommit)  # serves memory:// while registered
    try:
        destination = f"memory://relayout-{uuid.uuid4().hex[:8]}"
        with pytest.raises(CheckpointingError, match=r"NoopCommit\('memory://relayout-.*'\)\.commit\(.*\) "
                                                     r"returned, but the checkpoint the store holds now is not"):
            relayout_checkpoint(source, destination, ldc.StorageOptions())
    finally:
        unregister_store(NoopCommit)


def test_an_honest_third_party_commit_is_checked_at_no_cost_to_the_builtin_stores(tmp_path):
    asked = []

    class Counted(MemoryStore):
        def open_metadata(self):
            asked.append(self.location)
            return super().open_metadata()

    class CountedLocal(LocalStore):
        def open_metadata(self):
            asked.append(self.location)
            return super().open_metadata()

    store = Counted(MemoryStore.normalize(f"memory://honest-{uuid.uuid4().hex[:8]}", "test"))
    ldc.save(_state(0, 1, 1), store)
    assert asked == [store.location]  # the third party's commit: checked once, by the store's own view
    asked.clear()
    ldc.save(_state(0, 1, 2), CountedLocal(str(tmp_path / "ck")))  # LocalStore's own commit: not asked
    assert asked == [] and _loaded(store) == 1 and _loaded(str(tmp_path / "ck")) == 2


# -- 1.-3. two ranks: lying commits, store calls named, reserve, the load's wording --------------------------
class _Named(LocalStore):
    """Raises ``fault = (method, error)`` in ``method`` where set; ``lie``: its commit returns without one."""

    fault = None
    lie = False

    def _maybe(self, method):
        if self.fault is not None and self.fault[0] == method:
            raise _ERRORS[self.fault[1]](f"{method} broke")

    def commit(self, staging, metadata_json, marker):
        self._maybe("commit")
        if not self.lie:
            LocalStore.commit(self, staging, metadata_json, marker)


for _name in ("check_target", "new_staging", "begin", "write_blob", "make_durable", "reserve", "open_metadata"):
    def _faulty(self, *args, _name=_name, **kwargs):
        self._maybe(_name)
        return getattr(LocalStore, _name)(self, *args, **kwargs)
    setattr(_Named, _name, _faulty)

_SCENARIOS = [  # (method, error, the rank it fails on)
    ("check_target", "OSError", 0),
    ("new_staging", "RuntimeError", 0),
    ("begin", "OSError", 1),
    ("write_blob", "KeyError", 0),
    ("make_durable", "ValueError", 1),
    ("commit", "TimeoutError", 0),
]


def _two_ranks(rank, world, root):
    out = {}
    for method, error, on_rank in _SCENARIOS:
        if not _in_step(out):
            return out
        store = _Named(os.path.join(root, method))
        ldc.save(_state(rank, world, 1), store)
        store.fault = (method, error) if rank == on_rank else None
        out[method] = _outcome(lambda: ldc.save(_state(rank, world, 2), store))
        store.fault = None
        out[method + " then"] = _outcome(lambda: _loaded(store, rank, world))
    store = _Named(os.path.join(root, "liar"))
    ldc.save(_state(rank, world, 1), store)
    store.lie = True
    out["lie"] = _outcome(lambda: ldc.save(_state(rank, world, 2), store))  # the old code: "ok" on every rank
    store.lie = False
    out["lie then"] = _outcome(lambda: _loaded(store, rank, world))
    if _in_step(out):  # rank 1 cannot open it: both ranks word the failure alike
        store.fault = ("open_metadata", "KeyError") if rank == 1 else None
        out["open"] = _outcome(lambda: _loaded(store, rank, world))
        store.fault = None
    if _in_step(out):  # reserve raising on rank 0: a warning, the save goes on
        store.fault = ("reserve", "OSError")
        out["reserve"] = _outcome(lambda: ldc.AsyncSaver(reserve_targets=True).save(
            _state(rank, world, 5), store).finalize())
        store.fault = None
        out["reserve then"] = _outcome(lambda: _loaded(store, rank, world))
    return out


def test_third_party_store_calls_on_two_ranks_are_named_checked_and_worded_alike(tmp_path, caplog):
    results = run_distributed(_two_ranks, 2, str(tmp_path), timeout_s=GROUP_TIMEOUT_S)
    for rank, out in enumerate(results):
        for method, error, on_rank in _SCENARIOS:
            assert method in out, (rank, method, out)
            kind, message = out[method]
            assert kind in ("SaveFailedError", "CheckpointingError"), (rank, method, kind, message)
            first = message.split("\n--- traceback")[0]
            assert f"rank {on_rank}: " in first and f"{method} broke" in first, (rank, method, first)
            # the store (its repr) and the call, which the old code left out
            assert f"_Named('{tmp_path}/{method}')" in first and f"{method}" in first.split("_Named(", 1)[1], first
            assert out[method + " then"] == ("ok", 1), (rank, method, out[method + " then"])
        kind, message = out["lie"]
        assert kind == "SaveFailedError" and "is not this save's" in message and f"_Named('{tmp_path}/liar')" \
            in message and ".commit(" in message, (rank, out["lie"])
        assert out["lie then"] == ("ok", 1), (rank, out["lie then"])  # the previous checkpoint, never reported as 2
        kind, message = out["open"]
        assert kind == "CheckpointingError" and message.startswith(f"load from {tmp_path}/liar failed: rank 1: "), \
            (rank, out["open"])  # the old code: rank 1 said "load from the checkpoint failed"
        assert out["reserve"] == ("ok", None) and out["reserve then"] == ("ok", 5), (rank, out)
    assert results[0]["open"][1].split("\n--- traceback")[0] == results[1]["open"][1].split("\n--- traceback")[0]


# -- 4. still_committed raising -------------------------------------------------------------------------------
class _Unsure(LocalStore):
    """A store that is no file system to its readers (so a failed read asks ``still_committed``), whose
    ``still_committed`` raises ``error`` where set."""

    file_system = False
    error = None
    asked = 0

    def still_committed(self, path):
        self.asked += 1
        if self.error is not None:
            raise _ERRORS[self.error]("still_committed broke")
        return True


def _damaged(rank, world, root, error_on):
    store = _Unsure(os.path.join(root, "ck"))
    store.error = "Base"  # never asked by a save: it goes on as ever
    ldc.save(_state(rank, world, 1), store)
    saved_asked = store.asked
    get_comm().barrier()
    if rank == 0:  # every rank's read of w fails: its data is gone
        shutil.rmtree(os.path.join(root, "ck", "data"))
        os.makedirs(os.path.join(root, "ck", "data"))
    get_comm().barrier()
    store.error = error_on.get(rank)
    return saved_asked, store.asked, _outcome(lambda: _loaded(store, rank, world))


@pytest.mark.parametrize("error_on", [{1: "Base"}, {0: "KeyError", 1: "Base"}])
def test_still_committed_raising_leaves_the_reads_error_on_every_rank(tmp_path, error_on):
    results = run_distributed(_damaged, 2, str(tmp_path), error_on, timeout_s=GROUP_TIMEOUT_S)
    firsts = set()
    for rank, (saved_asked, asked, (kind, message)) in enumerate(results):
        assert saved_asked == 0, rank  # the save side never asks it
        assert kind == "CheckpointingError" and "replaced" not in message, (rank, kind, message)  # the old: unagreed
        firsts.add(message.split("\n--- traceback")[0])
    assert len(firsts) == 1, firsts


def test_still_committed_raising_in_one_process_is_a_warning_naming_the_store(tmp_path, caplog):
    store = _Unsure(str(tmp_path / "ck"))
    store.error = "Base"
    ldc.save(_state(0, 1, 1), store)
    assert store.asked == 0
    shutil.rmtree(tmp_path / "ck" / "data")
    (tmp_path / "ck" / "data").mkdir()
    with caplog.at_level(logging.WARNING, logger="lightning_distckpt"), pytest.raises(CheckpointingError) as e:
        _loaded(store)
    assert "replaced" not in str(e.value) and store.asked >= 1
    assert f"_Unsure('{tmp_path}/ck').still_committed(" in caplog.text and "_Cancelled: still_committed broke" \
        in caplog.text, caplog.text


def test_a_commit_check_that_fails_keeps_the_staging_for_clean_and_clean_removes_it():
    store = _MemoryLiar(MemoryStore.normalize(f"memory://liar-{uuid.uuid4().hex[:8]}", "test"))
    ldc.save(_state(0, 1, 1), store)
    store.lie = "noop"
    with pytest.raises(ldc.SaveFailedError, match="left to `clean`"):
        ldc.save(_state(0, 1, 2), store)
    (leftover,) = store.find_leftovers()
    assert f"{leftover.path}/common.pt" in _BLOBS  # kept, not discarded
    store.remove_leftover(leftover)
    assert store.find_leftovers() == [] and _loaded(store) == 1
