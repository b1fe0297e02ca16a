"""Collective loads where the ranks do not see the same thing, and read plans over a metadata.json
whose stored shards overlap.

* A ``last``-style link moved by a save between two ranks' opens: each rank opened a different
  committed checkpoint of the same layout. The exchange loaders send the chunk one rank read to
  the others, so each rank got a mix of both checkpoints' values, with no error; every-rank reads
  gave each rank a different model. Now every rank raises the same ValidationError naming both
  paths before anything is read (``reading/request.check_alike``, by the SHA-256s the commit
  markers record), while an identical copy of the checkpoint at another path (a node-local copy)
  still loads.
* Ranks passing different ``strict`` modes (one looking for missing keys), different loaders
  (every-rank against an exchange, or exchanges of different ``bucket_bytes``) or exchange groups
  that do not partition the load's group entered different collectives: a hang until the group's
  timeout, a gloo abort on mismatched message sizes, or one collective's message read as
  another's (a TypeError on one rank, a ValueError on the other). Now the same ArgumentError on
  every rank, at once.
* A metadata.json whose stored shards overlap by as many elements as they leave uncovered passed
  the read plans' element count: the uncovered rows kept the template's values (or uninitialized
  memory for a template without data). Now a FormatError naming the key and both shards, on every
  rank, for boxes and for flattened pieces (``planning/coverage.check_disjoint``).

Hang guards: each group times out after ``GROUP_TIMEOUT_S``; a rank stuck in a collective fails
the test with a CollectiveError instead of the error asserted. Nothing waits on time otherwise.
"""

import hashlib
import json
import os
import shutil
import time

import pytest
import torch
import torch.distributed as dist

import lightning_distckpt as ldc
from dist_utils import run_distributed
from lightning_distckpt.comm import get_comm
from lightning_distckpt.core.errors import ArgumentError, CheckpointingError, FormatError, ValidationError
from lightning_distckpt.core.strict import StrictHandling
from lightning_distckpt.planning.metadata import CheckpointIndex
from lightning_distckpt.reading import TwoStageDataParallelLoader
from lightning_distckpt.reading.checkpoint import open_checkpoint
from lightning_distckpt.reading.loaders import resolve_loader
from lightning_distckpt.storage.layout import COMMIT_MARKER, METADATA_FILE

GROUP_TIMEOUT_S = 30
LOADERS = ("every_rank", "parallel", "two_stage")


def _template(rank, value=0.0):
    """A data-parallel replica: both ranks ask for the same chunks (so the exchange shares them)."""
    return {f"w{i}": ldc.ShardedTensor.from_rank_offsets(f"w{i}", torch.full((32, 16), value), replica_id=rank)
            for i in range(4)}


def _outcome(fn):
    try:
        out = fn()
        return "ok", {k: sorted(v.unique().tolist()) for k, v in out.items()}
    except CheckpointingError as e:
        return type(e).__name__, str(e)


def _wait_for(path):
    """Until the other rank has made ``path``; the group's timeout bounds a failed peer."""
    deadline = time.monotonic() + GROUP_TIMEOUT_S
    while not os.path.exists(path):
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.01)


def _moved_link(rank, world, root):
    a, b, link = (os.path.join(root, n) for n in ("A", "B", "last"))
    ldc.save(_template(rank, 1.0), a)
    ldc.save(_template(rank, 2.0), b)
    if rank == 0:
        shutil.copytree(a, os.path.join(root, "A_copy"))  # a node-local copy: the same checkpoint
    get_comm().barrier()
    results = {}
    for n, name in enumerate(LOADERS):
        if rank == 0:
            os.symlink(a, link + ".new")
            os.replace(link + ".new", link)
        get_comm().barrier()
        moved = os.path.join(root, f"moved{n}")

        def opener(moved=moved):
            if rank == 1:
                _wait_for(moved)  # rank 0 opened A, then a save moved the link to B
            source = open_checkpoint(link)
            if rank == 0:
                os.symlink(b, link + ".new")
                os.replace(link + ".new", link)
                open(moved, "w").close()
            return source

        loader = resolve_loader(name)
        results[name] = _outcome(lambda loader=loader, opener=opener: loader.load(
            _template(rank), opener, get_comm(), StrictHandling.ASSUME_OK_UNEXPECTED)[0])
    # the same checkpoint at two paths loads: identity is the content the commit markers record
    results["copy"] = _outcome(lambda: ldc.load(_template(rank), a if rank == 0 else os.path.join(root, "A_copy"),
                                                loader="two_stage"))
    return results


def test_a_link_moved_between_the_ranks_opens_fails_every_rank_alike(tmp_path):
    results = run_distributed(_moved_link, 2, str(tmp_path), timeout_s=GROUP_TIMEOUT_S)
    for name in LOADERS:
        kinds = {r[name][0] for r in results}
        assert kinds == {ValidationError.__name__}, (name, results)
        message = results[0][name][1]
        assert results[1][name][1] == message
        assert str(tmp_path / "A") in message and str(tmp_path / "B") in message
        assert "different checkpoints" in message and "nothing was read" in message
    assert all(r["copy"] == ("ok", {f"w{i}": [1.0] for i in range(4)}) for r in results), results


def _disagreeing_arguments(rank, world, path):
    ldc.save(_template(rank, 3.0), path)
    alone = [dist.new_group([r]) for r in range(world)]  # collective: every rank makes every group
    cases = {
        # return_all looks for missing keys (a gather and a broadcast more); assume_ok does not
        "strict": lambda: ldc.load(_template(rank), path, strict="return_all" if rank == 0 else "assume_ok_unexpected"),
        "loader": lambda: ldc.load(_template(rank), path, loader="every_rank" if rank == 0 else "two_stage"),
        # the exchange plan buckets by bucket_bytes: different plans, different message sizes
        "bucket_bytes": lambda: ldc.load(_template(rank), path, loader=TwoStageDataParallelLoader(
            bucket_bytes=256 << 10 if rank == 0 else 0)),
        # rank 0 exchanges over the whole group, rank 1 alone: not a partition of the load's group
        "groups": lambda: ldc.load(_template(rank), path, loader=TwoStageDataParallelLoader(
            None if rank == 0 else alone[1])),
    }
    out = {name: _outcome(fn) for name, fn in cases.items()}
    # schedules may differ (parallel reads first, two-stage pipelines): the same plan, loads alike
    out["schedules"] = _outcome(lambda: ldc.load(_template(rank), path,
                                                 loader="parallel" if rank == 0 else "two_stage"))
    # each rank alone in its group is a partition: each reads its own
    out["alone"] = _outcome(lambda: ldc.load(_template(rank), path, loader=TwoStageDataParallelLoader(alone[rank])))
    return out


def test_ranks_passing_different_strict_modes_or_loaders_fail_alike_without_hanging(tmp_path):
    results = run_distributed(_disagreeing_arguments, 2, str(tmp_path / "ck"), timeout_s=GROUP_TIMEOUT_S)
    for name, words in (("strict", ("different strict modes", "return_all", "assume_ok_unexpected")),
                        ("loader", ("different loaders", "every_rank", "bucket_bytes=262144")),
                        ("bucket_bytes", ("different loaders", "bucket_bytes=262144", "bucket_bytes=0")),
                        ("groups", ("do not partition", "ranks [0]: a group of 2; ranks [1]: a group of 1"))):
        assert results[0][name] == results[1][name], (name, results)
        kind, message = results[0][name]
        assert kind == ArgumentError.__name__ and str(tmp_path / "ck") in message, (name, message)
        assert all(w in message for w in words), (name, message)
    assert all(r[n] == ("ok", {f"w{i}": [3.0] for i in range(4)}) for r in results for n in ("schedules", "alone"))


def _explicit_shards(path, edit):
    """Rewrite ``path``'s index with every shard listed (even splits expanded), ``edit(tensors)``
    applied, and the commit marker's checksum kept consistent: a metadata.json that lies well."""
    meta = json.loads(open(os.path.join(path, METADATA_FILE), "rb").read())
    index = CheckpointIndex.from_json(meta, path, len(os.listdir(os.path.join(path, "data"))))
    for entry in index.tensors.values():
        entry.shards = entry.shards  # an even split as its list of shards
    meta["tensors"] = index.to_json()["tensors"]
    edit(meta["tensors"])
    raw = json.dumps(meta).encode()
    open(os.path.join(path, METADATA_FILE), "wb").write(raw)
    marker = json.loads(open(os.path.join(path, COMMIT_MARKER), "rb").read())
    marker["metadata_sha256"] = hashlib.sha256(raw).hexdigest()
    open(os.path.join(path, COMMIT_MARKER), "w").write(json.dumps(marker))


FULL = torch.arange(64.0).reshape(16, 4)


def _save_split(rank, world, path):
    """``box``: rows split over the ranks; ``flat``: the whole tensor in two flattened pieces."""
    ldc.save({"box": ldc.ShardedTensor.from_rank_offsets("box", FULL.chunk(2)[rank].clone(), (0, rank, 2)),
              "flat": ldc.ShardedTensor.from_rank_offsets_flat(
                  "flat", FULL.reshape(-1)[32 * rank:32 * (rank + 1)].clone(), (16, 4),
                  flattened_range=slice(32 * rank, 32 * (rank + 1)))}, path)


def _shift_second_shard(tensors):
    for s in tensors["box"]["shards"]:
        if s["offset"][0] == 8:
            s["offset"][0] = 4  # rows 4..12: rows 4..8 stored twice, rows 12..16 by nobody
    for s in tensors["flat"]["shards"]:
        if s["flat"][0] == 32:
            s["flat"] = [16, 48]  # elements 16..32 twice, 48..64 by nobody


def _load_lying(rank, world, path):
    out = {}
    for name in ("every_rank", "two_stage"):
        for key in ("box", "flat"):
            for data in (torch.full((16, 4), -1.0), None):  # None: the loader allocates the destination
                st = (ldc.ShardedTensor.from_rank_offsets(key, data, replica_id=rank) if data is not None else
                      ldc.ShardedTensor(key=key, data=None, dtype=torch.float32, local_shape=(16, 4),
                                        global_shape=(16, 4), global_offset=(0, 0), axis_fragmentations=(1, 1),
                                        replica_id=rank))
                out[(name, key, data is None)] = _outcome(
                    lambda sd={key: st}, loader=name: ldc.load(sd, path, loader=loader))
    return out


def test_stored_shards_overlapping_as_much_as_they_leave_out_are_refused(tmp_path):
    path = str(tmp_path / "ck")
    run_distributed(_save_split, 2, path, timeout_s=GROUP_TIMEOUT_S)
    honest = ldc.load({"box": ldc.ShardedTensor.from_rank_offsets("box", torch.zeros(16, 4)),
                       "flat": ldc.ShardedTensor.from_rank_offsets("flat", torch.zeros(16, 4))}, path)
    assert torch.equal(honest["box"], FULL) and torch.equal(honest["flat"], FULL)
    _explicit_shards(path, _shift_second_shard)
    results = run_distributed(_load_lying, 2, path, timeout_s=GROUP_TIMEOUT_S)
    assert results[0] == results[1]
    for (name, key, _), (kind, message) in results[0].items():
        assert kind == FormatError.__name__, (name, key, message)
        assert f"{path}: metadata.json: {key!r}: stored shards overlap" in message, message
        assert "written by rank 0" in message and "written by rank 1" in message, message
    with pytest.raises(FormatError, match="stored shards overlap"):
        ldc.load({"box": ldc.ShardedTensor.from_rank_offsets("box", torch.zeros(16, 4))}, path)
    # a request inside one shard reads no overlap: it still loads (the lie is where it is read)
    part = ldc.load({"box": ldc.ShardedTensor.from_rank_offsets("box", torch.zeros(4, 4), (0, 0, 4))}, path)
    assert torch.equal(part["box"], FULL[:4])
