"""Stores written by third parties misbehave while a checkpoint is read: ``load(template, store)`` and the
single-process readers given a store whose reading calls raise anything, on one rank only, or lie. Expected:
every rank raises the same CheckpointingError naming the store (its repr) and the call, promptly (no rank
left waiting in a collective), and never wrong values. (The save side: test_trust_store_plugin_redteam.py.)

What a red-team probe found (each on the old code):

* A store raising a BaseException that is no Exception (asyncio's ``CancelledError``, a library's own) in
  ``open_metadata``, ``open_reader``, ``ts_context``, ``kvstore_spec`` or ``read_blob`` on one rank: that rank
  raised it alone, out of every agreement (they catch Exception), and its peers waited in the load's next
  collective until the group's timeout (CollectiveError). Now every reading call of a store goes through
  ``storage/store.asked``: anything but a CheckpointingError (or an interrupt) becomes a CheckpointingError
  naming the store and the call, which the load agrees on like any error.
* Any other error from those calls (KeyError, OSError, RuntimeError) was agreed, but said only
  ``rank 1: KeyError: 'x'``: not which store, nor which call. Now ``_Faulty('/x/ck').open_metadata() failed:
  KeyError: ...``. The single-process readers (``load_common_state_dict``, ``load_tensors_metadata``,
  ``load_sharded_metadata``, ``load_plain_tensors``, ``validate``) raised the bare error.
* ``still_committed`` raising, asked after a read failed: its error replaced the read's. Now a WARNING naming
  the store, and the read's own error stands (``storage/store.still_committed``; not tested here).

Found sound: ``writer_store`` raising in ``validate`` (now a CheckpointingError: reported as a problem of that
rank's store, the rest still checked); ``still_committed`` lying (False: the failure is called a replacement,
True: called damage; an error either way, never values); ``read_blob`` returning None or the wrong bytes
(covered by the save-side file); a store ``copy.copy`` refuses is copied only for other options (ArgumentError
naming it, save-side file); nothing of ours deep-copies or pickles a store on the load path.

Hang guards: the group times out after ``GROUP_TIMEOUT_S``; a rank left waiting gets a CollectiveError, told
apart from the agreed error, and a scenario stops at the first outcome not agreed. Nothing waits on time.
"""

from __future__ import annotations

import asyncio
import os
import uuid

import pytest
import torch

import lightning_distckpt as ldc
from dist_utils import run_distributed
from lightning_distckpt.core.errors import CheckpointingError
from lightning_distckpt.storage.local_store import LocalStore
from lightning_distckpt.validation.checks import validate_checkpoint
from memory_store import MemoryStore
from trust.test_trust_load_one_rank_fails_redteam import _in_step
from trust.test_trust_load_one_rank_fails_redteam import _outcome as _caught

GROUP_TIMEOUT_S = 30  # a rank left waiting gets a CollectiveError, told apart from the agreed error


class _Cancelled(BaseException):
    """Not an Exception, as asyncio's CancelledError: a store using asyncio may raise it."""


_ERRORS = {"KeyError": KeyError, "OSError": OSError, "RuntimeError": RuntimeError, "Base": _Cancelled,
           "Cancelled": asyncio.CancelledError}
_CALLS = ("open_metadata", "read_blob", "open_reader", "ts_context", "kvstore_spec", "writer_store", "facts",
          "still_committed")


def _outcome(fn):
    """As the one-rank-fails file's, and a BaseException raised on this rank alone as "unagreed"."""
    try:
        return _caught(fn)
    except Exception:
        raise
    except BaseException as e:  # noqa: BLE001 - judged by the test
        return f"unagreed {type(e).__name__}", str(e)


def _with_faults(base):
    """``base`` whose reading calls raise ``fault = (call, error name)`` where set."""
    class Faulty(base):
        fault = None

    for name in _CALLS:
        def call(self, *args, _name=name, **kwargs):
            if self.fault is not None and self.fault[0] == _name:
                raise _ERRORS[self.fault[1]](f"{_name} broke")
            return getattr(base, _name)(self, *args, **kwargs)
        setattr(Faulty, name, call)
    Faulty.__name__ = Faulty.__qualname__ = f"_Faulty{base.__name__}"
    return Faulty


_FaultyLocal = _with_faults(LocalStore)
_FaultyMemory = _with_faults(MemoryStore)


# -- two ranks: a store raising on rank 1 only -------------------------------------------------------------
_SCENARIOS = [  # (call, error, loaders)
    ("open_metadata", "Base", ("every_rank", "parallel", "two_stage")),
    ("open_metadata", "KeyError", ("every_rank",)),
    ("open_reader", "Cancelled", ("every_rank", "parallel", "two_stage")),
    ("ts_context", "Base", ("parallel",)),
    ("kvstore_spec", "Base", ("two_stage",)),
    ("read_blob", "Base", ("every_rank", "parallel")),
    ("read_blob", "OSError", ("two_stage",)),
]


def _template(rank, world, value=0.0):
    return {"w": ldc.ShardedTensor.from_rank_offsets("w", torch.full((4, 3), value), (0, rank, world))}


def _one_rank_fails(rank, world, root):
    store = _FaultyLocal(os.path.join(root, "ck"))
    ldc.save({**_template(rank, world, 1.0), "step": 1}, store)
    out = {}
    for call, error, loaders in _SCENARIOS:
        for loader in loaders:
            if not _in_step(out):
                return out
            template = _template(rank, world)
            store.fault = (call, error) if rank == 1 else None
            kind, message = _outcome(lambda: ldc.load(template, store, loader=loader)["step"])
            store.fault = None
            out[f"{call}-{error}-{loader}"] = (kind, message.split("\n--- traceback")[0])
    template = _template(rank, world)
    out["then"] = _outcome(lambda: (ldc.load(template, store)["step"], template["w"].data.tolist()))
    return out


def test_a_store_raising_on_one_rank_while_loading_fails_every_rank_alike_naming_it(tmp_path):
    results = run_distributed(_one_rank_fails, 2, str(tmp_path), timeout_s=GROUP_TIMEOUT_S)
    for rank, out in enumerate(results):
        for call, error, loaders in _SCENARIOS:
            for loader in loaders:
                name = f"{call}-{error}-{loader}"
                assert name in out, (rank, name, out)  # the old code: stopped at the first rank left waiting
                kind, message = out[name]
                assert kind == "CheckpointingError", (rank, name, kind, message)
                assert "rank 1: " in message and f"{call} broke" in message, (rank, name, message)
                assert f"_FaultyLocalStore('{tmp_path}" in message and f".{call}(" in message, (rank, name, message)
        assert out["then"] == ("ok", (1, [[1.0] * 3] * 4)), (rank, out["then"])


# -- one process: the single-process readers, validate, inspect -------------------------------------------
def _saved_memory_store():
    store = _FaultyMemory(MemoryStore.normalize(f"memory://load-plugin-{uuid.uuid4().hex[:8]}", "test"))
    ldc.save({"w": ldc.ShardedTensor.from_rank_offsets("w", torch.full((8, 4), 2.0)),
              "obj": ldc.ShardedObject("obj", {"a": 1}, (1,), (0,)), "step": 2}, store)
    return store


_READERS = {
    "load": lambda s: ldc.load({"w": ldc.ShardedTensor.from_rank_offsets("w", torch.zeros(8, 4))}, s),
    "load_common_state_dict": ldc.load_common_state_dict,
    "load_tensors_metadata": ldc.load_tensors_metadata,
    "load_sharded_metadata": ldc.load_sharded_metadata,
    "load_plain_tensors": ldc.load_plain_tensors,
}


@pytest.mark.parametrize("error", ["KeyError", "Cancelled"])
@pytest.mark.parametrize("reader", sorted(_READERS))
def test_a_store_failing_to_open_metadata_is_named_by_every_reader(reader, error):
    store = _saved_memory_store()
    store.fault = ("open_metadata", error)
    with pytest.raises(CheckpointingError, match=r"_FaultyMemoryStore\('memory://load-plugin-.*'\)"
                                                 r"\.open_metadata\(\) failed: \w+: '?open_metadata broke"):
        _READERS[reader](store)


@pytest.mark.parametrize("reader", ["load", "load_common_state_dict"])
def test_a_store_failing_to_read_common_is_named(reader):
    store = _saved_memory_store()
    store.fault = ("read_blob", "Cancelled")
    with pytest.raises(CheckpointingError, match=r"_FaultyMemoryStore\(.*\.read_blob\(.*'common.pt'\) failed: "
                                                 r"CancelledError: read_blob broke"):
        _READERS[reader](store)


def test_a_store_failing_to_say_what_a_writer_holds_is_a_problem_validate_names():
    store = _saved_memory_store()
    store.fault = ("writer_store", "Base")
    report = validate_checkpoint(store)  # the old code: the bare BaseException out of validate
    assert not report.ok and any(p.startswith("rank 0: _FaultyMemoryStore(") and "writer_store(" in p
                                 for p in report.problems), report.problems
