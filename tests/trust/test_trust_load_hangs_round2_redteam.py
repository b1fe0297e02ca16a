"""One rank fails during a load after the ranks agreed it could take part (second pass): every rank raises
the same error, naming the failing rank and what failed, and none waits in a collective for it.

What this probe found (each a hang on the old code: the failing rank raised alone, its partners waited in
the next broadcast, receive or agreement until the group's timeout, then raised CollectiveError):

* Exchange loaders (``"parallel"``, ``"two_stage"``): memory taken between the try of a rank's largest
  buffers (``exchange_guard.prepare``) and their allocation. Natural here: tied weights, two template
  entries of one key without data; the second gets a copy of the first when the chunk arrives
  (``_deliver``'s clone), memory the try did not count. The clone itself raised between two messages; or,
  one op at a time, the next op's buffer could not be had even alone and the schedule raised. Now a failed
  clone is recorded like a failed copy, and a rank whose op cannot get its buffers alone records the
  failure, drops its results and takes part in its remaining ops with one spare buffer
  (``exchange_guard.take_part``): the same CheckpointingError on every rank, the next load completes.
* Sharding from rank 0 (``ingest``): a receiver whose shards, cut as the broadcasts arrive, took the memory
  the largest broadcast's buffer had when tried; and rank 0 whose own shards did so, where its fallback,
  ``torch.zeros`` of the message, failed as well. Now a buffer that cannot be had waits for the broadcasts
  in flight, and alone fails that rank's transfer (recorded, shards dropped) while it takes part with a
  spare buffer (rank 0 may send the source tensor's own bytes): the same error on every rank.
* ``load`` with a template only one rank's leaves make wrong (two leaves whose paths give one key):
  ``shard_tensors`` raised on that rank before any collective. Now the error travels as that rank's failure
  to open the checkpoint, agreed in the loader's first collective.

Found sound, kept as regressions: a rank's own data file removed, or replaced by a directory, after the
checkpoint was opened (by a factory's ``build_fn``, which runs in between), and a template destination whose
``copy_`` fails (an expanded tensor), with every loader.

Memory fails for real: ``RLIMIT_AS`` in one rank alone, after a warm-up, with margins of 28 MiB or more on
each side of what must fit and what must not (``test_trust_load_one_rank_fails_redteam.py``'s helpers), glibc
held to the malloc arenas it has (a failed allocation would otherwise map a new one, and what fits after it
would be 64 MiB less). On the old code the exchange scenario stops at its first case ("parallel"); its
one-op-at-a-time case, run alone there, leaves rank 0 waiting too.
Hang guard: each group times out after ``GROUP_TIMEOUT_S``; a rank left waiting gets a CollectiveError,
not the error asserted, and a scenario stops at the first outcome not agreed. Nothing waits on time.
"""

import ctypes
import os
import sys

import pytest
import torch

import lightning_distckpt as ldc
from dist_utils import run_distributed
from trust.test_trust_load_one_rank_fails_redteam import (_address_space, _first_lines, _in_step, _outcome,
                                                           _store_file)

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS and /proc/self/status")

GROUP_TIMEOUT_S = 30
N = 4096  # a (N, N) float32 tensor: 64 MiB, a fresh mapping of its own
LOADERS = ("every_rank", "parallel", "two_stage")


def _loader(name):
    """A loader by name; "one_at_a_time": the two-stage loader admitting one op at a time."""
    from lightning_distckpt.reading.loaders import TwoStageDataParallelLoader

    return TwoStageDataParallelLoader(max_inflight_bytes=1) if name == "one_at_a_time" else name


def _one_arena():
    """glibc makes no further malloc arenas in this process: when an allocation fails it would map a new
    one (64 MiB of address space, kept), and what fits next would depend on it."""
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is not None:
        mallopt(-8, 1)  # M_ARENA_MAX


def _span(t):
    """(least, greatest) value of ``t``: one pass (``unique`` sorts)."""
    return float(t.min()), float(t.max())


def _agreed(results, cases):
    """Every rank reached every case, with the same outcome: (kind, first lines of the message)."""
    assert all(list(out) == list(cases) for out in results), results  # no rank stopped short, out of step
    for case in cases:
        assert _first_lines(results[1][case]) == _first_lines(results[0][case]), (case, results)
    return {case: _first_lines(results[0][case]) for case in cases}


# -- exchange: memory taken between the try and the exchange -------------------------------------------------
TIED_CASES = ("parallel", "two_stage", "one_at_a_time")  # ("every_rank" allocates it all first: agreed)


def _tied_template(rank, name, fresh):
    """Each stored key read into two entries (tied weights: one key), rank 1's without data (``fresh``: the
    load allocates the first and copies it into the second): "a" and "c"; one op at a time, "a" and then "b"
    into a column slice of a wider tensor on rank 1 (not contiguous: a buffer)."""
    def entry(key, data):
        return ldc.ShardedTensor.from_rank_offsets(key, data, replica_id=rank)

    out = {"a": entry("a", torch.zeros(N, N)), "a2": entry("a", torch.zeros(N, N))}
    if name != "one_at_a_time":
        out.update(c=entry("c", torch.zeros(N, N)), c2=entry("c", torch.zeros(N, N)))
    else:
        out["b"] = entry("b", torch.zeros(N, N + 1)[:, :N] if rank == 1 else torch.zeros(N, N))
    if rank == 1 and fresh:
        for k in ("a", "a2", "c", "c2"):
            if k in out:
                out[k].data = None
    return out


def _tied_short_of_memory(rank, world, root):
    _one_arena()
    path = os.path.join(root, "ck")
    ldc.save({k: ldc.ShardedTensor.from_rank_offsets(k, torch.full((N, N), i + 1.0), replica_id=rank)
              for i, k in enumerate("abc")}, path)
    out = {}
    for name in TIED_CASES:
        if not _in_step(out):
            break
        ldc.load(_tied_template(rank, name, False), path, loader=_loader(name))  # warm-up
        template = _tied_template(rank, name, True)
        # rank 1 has room for two 64 MiB tensors (what prepare allocates and tries: the destinations of "a" and
        # "c"; or that of "a" and b's buffer), not for a copy of "a" besides
        with _address_space((128 + 36) << 20, on=rank == 1):
            out[name] = _outcome(lambda: ldc.load(template, path, loader=_loader(name)) and "loaded")
    again = None
    if _in_step(out):  # still in step: a load with memory completes, exact
        again = _outcome(lambda: [_span(v) for v in ldc.load(_tied_template(rank, "one_at_a_time", True),
                                                             path).values()])
    return out, again


def test_memory_taken_during_the_exchange_fails_every_rank_alike(tmp_path):
    results = run_distributed(_tied_short_of_memory, 2, str(tmp_path), timeout_s=GROUP_TIMEOUT_S)
    agreed = _agreed([out for out, _ in results], TIED_CASES)
    for name, (kind, message) in agreed.items():
        assert kind == "CheckpointingError", (name, kind, message)
        assert "rank 1:" in message and "rank 0:" not in message, (name, message)
    for name in ("parallel", "two_stage"):  # the copy for the second entry fails (of "a", of "c" or both)
        assert "copying into another request for '" in agreed[name][1], agreed[name]
    # one op at a time, b's buffer (allocated after the copy of "a") fails even alone
    assert "rank 1: allocating 64.0 MiB on cpu for 'b' failed" in agreed["one_at_a_time"][1], agreed
    assert all(again == ("ok", [(1.0, 1.0), (1.0, 1.0), (2.0, 2.0)]) for _, again in results), results


# -- ingest: a receiver, or rank 0, short of memory in the middle of the broadcasts ------------------------
def _ingest(rank, sources, entries, **options):
    from lightning_distckpt.ingest.api import broadcast_and_shard_state_dict, shard_broadcasted_state_dict

    out = {}
    if rank == 0:
        broadcast_and_shard_state_dict(sources, entries, out, **options)
    else:
        shard_broadcasted_state_dict(entries, out, **options)
    return out


def _receiver_short_of_memory(rank, world):
    """Every rank wants all of "a" (N x N float32: received straight into a 64 MiB shard) and of "b"
    (N x 2N float32) in bfloat16: "b" arrives in a 128 MiB buffer. Rank 1 has room for the largest buffer
    (tried first), not for it beside its shard of "a"."""
    _one_arena()
    sources = {"a": torch.full((N, N), 1.0), "b": torch.full((N, 2 * N), 2.0)} if rank == 0 else None
    entries = {"a": ldc.ShardedTensor.from_rank_offsets("a", torch.empty(N, N, device="meta"), replica_id=rank),
               "b": ldc.ShardedTensor.from_rank_offsets("b", torch.empty(N, 2 * N, dtype=torch.bfloat16,
                                                                         device="meta"), replica_id=rank)}

    def shard():
        out = _ingest(rank, sources, entries)
        return [_span(out[k]) for k in "ab"]

    warm = _outcome(shard)
    with _address_space((128 + 32) << 20, on=rank == 1):
        short = _outcome(shard)
    again = _outcome(shard) if _in_step({0: short}) else None
    return warm, short, again


def test_a_receiver_whose_shards_took_the_memory_fails_every_rank_alike():
    results = run_distributed(_receiver_short_of_memory, 2, timeout_s=GROUP_TIMEOUT_S)
    assert results[0] == results[1], results
    warm, (kind, message), again = results[0]
    assert warm == again == ("ok", [(1.0, 1.0), (2.0, 2.0)]), results  # still in step afterwards
    assert kind == "CheckpointingError", (kind, message)
    failures = message.split(" from rank 0: ", 1)[1]
    assert failures.startswith("rank 1: allocating 128.0 MiB on cpu for the broadcast of 'b' failed"), message
    assert "rank 0:" not in failures, message


def _sender_short_of_memory(rank, world):
    """Rank 0 keeps all of "a" (N x N float32: a 64 MiB shard) and sends rank 1 its last eighth of the
    columns (an 8 MiB buffer: not contiguous), then the right half of "b" (N x 2N: a 64 MiB buffer), one
    broadcast at a time. Rank 0 has room for the largest buffer (tried first), not for it beside its shard
    of "a"."""
    _one_arena()
    sources = {"a": torch.full((N, N), 1.0), "b": torch.full((N, 2 * N), 2.0)} if rank == 0 else None
    if rank == 0:
        entries = {"a": ldc.ShardedTensor.from_rank_offsets("a", torch.empty(N, N, device="meta"))}
    else:
        entries = {"a": ldc.ShardedTensor.from_rank_offsets("a", torch.empty(N, N // 8, device="meta"), (1, 7, 8)),
                   "b": ldc.ShardedTensor.from_rank_offsets("b", torch.empty(N, N, device="meta"), (1, 1, 2))}

    def shard():
        out = _ingest(rank, sources, entries, max_inflight_bytes=1)
        return {k: (tuple(v.shape), _span(v)) for k, v in out.items()}

    warm = _outcome(shard)
    with _address_space((72 + 28) << 20, on=rank == 0):
        short = _outcome(shard)
    again = _outcome(shard) if _in_step({0: short}) else None
    return warm, short, again


def test_rank_0_whose_shards_took_the_memory_fails_every_rank_alike():
    results = run_distributed(_sender_short_of_memory, 2, timeout_s=GROUP_TIMEOUT_S)
    for rank, (warm, (kind, message), again) in enumerate(results):
        want = ({"a": ((N, N), (1.0, 1.0))} if rank == 0
                else {"a": ((N, N // 8), (1.0, 1.0)), "b": ((N, N), (2.0, 2.0))})
        assert warm == again == ("ok", want), (rank, results)  # still in step afterwards
        assert kind == "CheckpointingError", (kind, message)
        failures = message.split(" from rank 0: ", 1)[1]
        assert failures.startswith("rank 0: allocating 64.0 MiB on cpu for the broadcast of 'b' failed"), message
        assert "rank 1:" not in failures, message
    assert results[0][1] == results[1][1], results


# -- load: a template only one rank's leaves make wrong ------------------------------------------------------
def _conflicting_template(rank, world, root):
    path = os.path.join(root, "ck")
    ldc.save({"x": {"y": torch.ones(4)}}, path)
    template = {"x/y": torch.zeros(4), "x": {"y": torch.zeros(4)}} if rank == 1 else {"x": {"y": torch.zeros(4)}}
    out = {}
    for name in LOADERS:
        if not _in_step(out):
            break
        out[name] = _outcome(lambda: ldc.load(template, path, loader=name) and "loaded")
    again = _outcome(lambda: ldc.load({"x": {"y": torch.zeros(4)}}, path)["x"]["y"].tolist()) if _in_step(out) \
        else None
    return out, again


def test_a_template_only_one_rank_makes_wrong_fails_every_rank_alike(tmp_path):
    results = run_distributed(_conflicting_template, 2, str(tmp_path), timeout_s=GROUP_TIMEOUT_S)
    for out, again in results:
        assert again == ("ok", [1.0] * 4), results  # still in step afterwards
        for name in LOADERS:
            kind, message = out[name]
            assert kind == "ShardingError", (name, kind, message)
            assert "rank 1: the state dict: the tensors at ['x/y'] and ['x']['y'] would both be stored as " \
                   "'x/y'" in message, (name, message)
            assert "rank 0:" not in message, (name, message)


# -- found sound: a rank's own data gone after the open; a destination refusing the copy -------------------
def _own_data_gone_after_open(rank, world, root):
    from lightning_distckpt.core.mapping import ShardedTensorFactory

    def state(fill):
        rows = torch.full((256, 128), rank + 1.0 if fill else 0.0)
        return {"split": ldc.ShardedTensor.from_rank_offsets("split", rows, (0, rank, world)),
                "rep": ldc.ShardedTensor.from_rank_offsets("rep", torch.full((32, 16), 7.0 if fill else 0.0),
                                                           replica_id=rank)}

    out = {}
    for how in ("removed", "a directory"):
        for name in LOADERS:
            if not _in_step(out):
                break
            path = os.path.join(root, f"{how}_{name}")
            ldc.save(state(True), path)

            def build(key, t, replica_id, flat, path=path, how=how):
                if rank == 1:  # runs once the checkpoint is open, before anything is read
                    data = _store_file(path, 1)
                    os.remove(data)
                    if how == "a directory":
                        os.mkdir(data)
                return {"split": ldc.ShardedTensor.from_rank_offsets("split", t, (0, rank, world))}

            template = state(False)
            template["split"] = ShardedTensorFactory("split", template["split"].data, build, lambda p: p["split"])
            out[how, name] = _outcome(lambda: ldc.load(template, path, loader=name) and "loaded")
    return out


def test_a_rank_whose_own_data_goes_after_the_open_fails_every_rank_alike(tmp_path):
    results = run_distributed(_own_data_gone_after_open, 2, str(tmp_path), timeout_s=GROUP_TIMEOUT_S)
    cases = [(how, name) for how in ("removed", "a directory") for name in LOADERS]
    for (how, name), (kind, message) in _agreed(results, cases).items():
        assert kind not in ("ok", "CollectiveError") and not kind.startswith("unagreed"), (how, name, kind, message)
        assert "rank 1:" in message and "rank 0:" not in message, (how, name, message)
        assert str(tmp_path / f"{how}_{name}") in message, (how, name, message)
        assert "store of rank 1" in message or "rank_00001" in message, (how, name, message)


def _refused_copy(rank, world, root):
    path = os.path.join(root, "ck")
    ldc.save({"rep": ldc.ShardedTensor.from_rank_offsets("rep", torch.full((32, 16), 7.0), replica_id=rank)}, path)
    out = {}
    for name in LOADERS:
        if _in_step(out):
            # rank 1's destination is one row seen 32 times: a copy into it must fail
            data = torch.zeros(16).expand(32, 16) if rank == 1 else torch.zeros(32, 16)
            template = {"rep": ldc.ShardedTensor.from_rank_offsets("rep", data, replica_id=rank)}
            out[name] = _outcome(lambda: ldc.load(template, path, loader=name) and "loaded")
    return out


def test_a_destination_whose_copy_fails_fails_every_rank_alike(tmp_path):
    results = run_distributed(_refused_copy, 2, str(tmp_path), timeout_s=GROUP_TIMEOUT_S)
    for name, (kind, message) in _agreed(results, LOADERS).items():  # refused before anything is read
        assert kind == "ShardingError", (name, kind, message)
        assert "rank 1:" in message and "rank 0:" not in message, (name, message)
        assert "which a load cannot write into" in message, (name, message)
