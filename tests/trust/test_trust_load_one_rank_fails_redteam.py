"""One rank fails during a collective load (or a local tier's recovery): every rank raises the same error,
naming the failing rank and what failed, and none waits in a collective for it.

What a red-team probe found (each a hang on the old code: the failing rank raised alone, its partners waited
in the exchange's next broadcast or receive until the group's timeout, then raised CollectiveError):

* A rank without memory for its part of an exchange loader's load (``"parallel"``, ``"two_stage"``): the
  destination of a template entry without data, or the buffer a chunk needs whose destination reads cannot
  land in (a non-contiguous view). ``torch.empty`` raised in the exchange's set-up or in ``admit``, between
  two of its messages. Now this rank's destinations are allocated and its largest buffers tried before the
  exchange, and the outcome travels with the requests the exchange gathers anyway: every rank raises the
  same CheckpointingError naming rank 1, the key and the MiB. (``"every_rank"`` already agreed; its message
  now names the key too.)
* A rank that cannot start a thread (``can't start new thread``: a pids limit, no room for a stack): the
  exchange's reader threads raised between its messages. Now that rank reads on its main thread, and the
  load completes, exact.
* A local tier's recovery whose sending rank cannot map the file it sends (no address space left): the
  sender raised between its sends, the receiver waited for them. Now each round's files are mapped before
  anything is posted and the ranks agree on it: the same error on every rank, naming the sender and the
  file; a later recovery (with memory) completes.
* Sharding from rank 0 (``ingest``) to a rank without memory for a broadcast's receive buffer: that rank
  raised before the broadcast, rank 0 waited in it. Now every rank tries the largest broadcast's buffer
  and they agree before the first: the same error everywhere, naming rank 1, the key and the MiB.

Found sound, kept as regressions: a chunk one rank alone reads damaged (a flipped byte, a truncated data
file, the data file missing) and a factory's ``merge_fn`` raising on one rank, with every loader.

Memory and threads fail for real: ``RLIMIT_AS`` in one rank alone, set after a warm-up (what a load maps
on its way is mapped then), with a margin below the allocation that must fail (for threads: a 1 GiB stack,
``threading.stack_size``, in 512 MiB of room). Hang guards: each group times out after ``GROUP_TIMEOUT_S``;
a rank left waiting gets a CollectiveError instead of the error asserted, and a scenario stops at the first
outcome not agreed (no collective follows, so the old code's ranks part instead of waiting in different
collectives for good). Nothing waits on time otherwise.
"""

import contextlib
import ctypes
import gc
import os
import resource
import shutil
import sys
import threading

import pytest
import torch

import lightning_distckpt as ldc
from dist_utils import run_distributed
from lightning_distckpt.core.errors import CheckpointingError, CollectiveError

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS and /proc/self/status")

GROUP_TIMEOUT_S = 60
LOADERS = ("every_rank", "parallel", "two_stage")
N = 4096  # a (N, N) float32 tensor: 64 MiB, above glibc's largest mmap threshold (32 MiB): a fresh mapping


def _outcome(fn):
    """("ok", value) or (the error's class name, its message)."""
    try:
        return "ok", fn()
    except CollectiveError as e:  # what a rank left waiting gets
        return "CollectiveError", str(e)
    except CheckpointingError as e:
        return type(e).__name__, str(e)
    except Exception as e:  # noqa: BLE001 - judged by the test: raised on one rank only
        return f"unagreed {type(e).__name__}", str(e)


def _in_step(outcomes):
    """No rank failed alone or was left waiting so far: else no collective may follow (the ranks are out of
    step: on the old code they would wait in different collectives for good), and the scenario stops."""
    return all(kind != "CollectiveError" and not kind.startswith("unagreed") for kind, _ in outcomes.values())


def _first_lines(outcome):
    """An outcome as every rank words it: another rank's traceback follows a foreign error's first line."""
    kind, message = outcome
    return kind, message.split("\n--- traceback of rank")[0] if isinstance(message, str) else message


def _mapped_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))


@contextlib.contextmanager
def _address_space(margin: int, on: bool = True):
    """This process may map ``margin`` more bytes than it has now (RLIMIT_AS), inside the block. Freed memory
    goes back first (a collection, ``malloc_trim``), so no allocation is served from memory freed earlier."""
    if not on:
        yield
        return
    gc.collect()
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)  # glibc's
    if trim is not None:
        trim(0)
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (_mapped_bytes() + margin, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def _full(i):
    return torch.full((N, N), float(i + 1))


def _replicated(rank, keys, kind="plain"):
    """Every rank asks for the whole of each key (data parallel: the exchange reads each once and sends it);
    rank 1's destinations are ``kind``: "plain", "fresh" (no data: the load allocates them) or "strided"
    (a column slice of a wider tensor: not contiguous)."""
    out = {}
    for k in keys:
        st = ldc.ShardedTensor.from_rank_offsets(k, torch.zeros(N, N), replica_id=rank)
        if rank == 1 and kind == "fresh":
            st.data = None
        elif rank == 1 and kind == "strided":
            st.data = torch.zeros(N, N + 1)[:, :N]
        out[k] = st
    return out


CASES = [(name, kind) for name in LOADERS for kind in ("fresh", "strided")]


def _short_of_memory(rank, world, root):
    path = os.path.join(root, "ck")
    ldc.save({"w": ldc.ShardedTensor.from_rank_offsets("w", _full(0), replica_id=rank)}, path)
    out = {}
    for name, kind in CASES:
        if not _in_step(out):
            break
        if kind == "fresh":
            ldc.load(_replicated(rank, ["w"]), path, loader=name)  # warm-up: what a load maps on its way
        template = _replicated(rank, ["w"], kind)
        # room for what comes before (a file read takes 16 MiB), not for the 64 MiB rank 1 needs, even should
        # a thread's stack be freed meanwhile
        with _address_space(28 << 20, on=rank == 1):
            out[name, kind] = _outcome(lambda: ldc.load(template, path, loader=name) and "loaded")
    return out


def test_a_rank_without_memory_for_its_part_fails_every_rank_alike(tmp_path):
    results = run_distributed(_short_of_memory, 2, str(tmp_path), timeout_s=GROUP_TIMEOUT_S)
    assert all(list(out) == CASES for out in results), results  # no rank stopped short, out of step
    for case, (kind, message) in results[0].items():
        assert results[1][case] == (kind, message), (case, results)
        assert kind == "CheckpointingError", (case, kind, message)
        assert "rank 1: allocating 64.0 MiB on cpu for 'w' failed" in message, (case, message)
        assert "rank 0" not in message, (case, message)


def _no_threads(rank, world, root):
    """Rank 1 cannot start a thread: its stacks would be larger than the address space left to it."""
    path = os.path.join(root, "ck")
    keys = ["a", "b"]
    state = {k: ldc.ShardedTensor.from_rank_offsets(k, torch.full((64, 32), float(i)), replica_id=rank)
             for i, k in enumerate(keys)}
    state["own"] = ldc.ShardedTensor.from_rank_offsets("own", torch.full((8, 32), float(rank)), (0, rank, world))
    ldc.save(state, path)
    out = {}
    for name in LOADERS:
        if not _in_step(out):
            break
        ldc.load(state, path, loader=name)  # warm-up
        template = {k: ldc.ShardedTensor.from_rank_offsets(k, torch.zeros(64, 32), replica_id=rank) for k in keys}
        template["own"] = ldc.ShardedTensor.from_rank_offsets("own", torch.zeros(8, 32), (0, rank, world))
        previous = threading.stack_size(1 << 30 if rank == 1 else 0)
        try:
            with _address_space(512 << 20, on=rank == 1):  # room for everything but a 1 GiB stack
                if rank == 1:
                    with pytest.raises(RuntimeError, match="can't start new thread"):
                        threading.Thread(target=int).start()
                out[name] = _outcome(lambda: {k: sorted(v.unique().tolist())
                                              for k, v in ldc.load(template, path, loader=name).items()})
        finally:
            threading.stack_size(previous)
    return out


def test_a_rank_that_cannot_start_a_thread_loads_on_its_main_thread(tmp_path):
    results = run_distributed(_no_threads, 2, str(tmp_path), timeout_s=GROUP_TIMEOUT_S)
    for rank, out in enumerate(results):
        for name in LOADERS:
            assert out.get(name) == ("ok", {"a": [0.0], "b": [1.0], "own": [float(rank)]}), (rank, name, out[name])


def _split_and_replicated(rank, world, fill=True):
    """Rows of "split" over the ranks (each rank alone reads its own) and replicated "rep" (read once and
    sent by the exchange loaders), a per-rank object; zeros as a template."""
    value = (lambda v: v) if fill else (lambda v: 0.0)
    return {"split": ldc.ShardedTensor.from_rank_offsets("split", torch.full((256, 128), value(rank + 1.0)),
                                                         (0, rank, world)),
            "rep": ldc.ShardedTensor.from_rank_offsets("rep", torch.full((32, 16), value(7.0)), replica_id=rank),
            "obj": ldc.ShardedObject("obj", {"rank": rank} if fill else None, (world,), (rank,))}


def _store_file(path, writer):
    """The largest data file of ``writer``'s store."""
    store = os.path.join(path, "data", f"rank_{writer:05d}")
    return max((os.path.join(d, f) for d, _, fs in os.walk(store) for f in fs), key=os.path.getsize)


def _damaged_store(rank, world, root):
    out = {}
    for how in ("flip", "truncate", "remove"):
        if not _in_step(out):
            break
        path = os.path.join(root, how)
        ldc.save(_split_and_replicated(rank, world), path)
        if rank == 1:  # rank 1 alone reads its store (its rows, its object; the others are rank 0's)
            data = _store_file(path, 1)
            raw = bytearray(open(data, "rb").read())
            if how == "flip":
                raw[len(raw) // 2] ^= 0x5A
                open(data, "wb").write(bytes(raw))
            elif how == "truncate":
                open(data, "wb").write(bytes(raw[:len(raw) // 2]))
            else:
                os.remove(data)
        ldc.save({"x": 1}, os.path.join(root, f"sync_{how}"))  # collective: the damage is done on every rank
        for name in LOADERS:
            if _in_step(out):
                template = _split_and_replicated(rank, world, False)
                out[how, name] = _outcome(lambda: ldc.load(template, path, loader=name))
    return out


def test_a_store_only_one_rank_reads_damaged_fails_every_rank_alike(tmp_path):
    results = run_distributed(_damaged_store, 2, str(tmp_path), timeout_s=GROUP_TIMEOUT_S)
    assert all(len(out) == 9 for out in results), results  # no rank stopped short, out of step
    for case, (kind, message) in results[0].items():
        assert results[1][case] == (kind, message), (case, results)
        assert kind not in ("ok", "CollectiveError") and not kind.startswith("unagreed"), (case, kind, message)
        assert "rank 1:" in message and "rank 0:" not in message, (case, message)
        assert str(tmp_path / case[0]) in message, (case, message)


def _failing_merge(rank, world, root):
    from lightning_distckpt.core.mapping import ShardedTensorFactory

    path = os.path.join(root, "ck")
    ldc.save({"w": ldc.ShardedTensor.from_rank_offsets("w", torch.arange(32.0).view(4, 8), replica_id=rank)}, path)

    def merge(parts):
        if rank == 1:
            raise ValueError("this rank's merge refuses")
        return parts["w"]

    def template():
        return {"f": ShardedTensorFactory("f", torch.zeros(4, 8), lambda key, t, replica_id, flat: {
            "w": ldc.ShardedTensor.from_rank_offsets("w", t, replica_id=rank)}, merge)}

    out = {}
    for name in LOADERS:
        if _in_step(out):
            out[name] = _outcome(lambda: ldc.load(template(), path, loader=name))
    return out


def test_a_merge_fn_that_fails_on_one_rank_fails_every_rank_alike(tmp_path):
    results = run_distributed(_failing_merge, 2, str(tmp_path), timeout_s=GROUP_TIMEOUT_S)
    assert all(list(out) == list(LOADERS) for out in results), results  # no rank stopped short, out of step
    for name in LOADERS:
        kind, message = _first_lines(results[0][name])
        assert _first_lines(results[1][name]) == (kind, message), (name, results)
        assert kind == "CheckpointingError" and "rank 1: ValueError: this rank's merge refuses" in message, message


ROWS = 8192  # "w" of (2 * ROWS, 2048) float32 split by rows: each rank's store is 64 MiB


def _recover_with_a_sender_short_of_memory(rank, world, tmp):
    from lightning_distckpt.comm import get_comm
    from lightning_distckpt.tiers import LocalTier
    from tiers.tier_helpers import options

    def state(fill):
        rows = torch.arange(ROWS, dtype=torch.float32).view(ROWS, 1) + rank * ROWS if fill else torch.zeros(ROWS, 1)
        return {"w": ldc.ShardedTensor.from_rank_offsets("w", rows.expand(ROWS, 2048).clone(), (0, rank, world))}

    tier = LocalTier(options(tmp, ranks_per_node=1))
    tier.save(state(True), 10)
    tier.close()
    get_comm().barrier()
    if rank == 1:  # node1 is lost: its recovery fetches rank 1's store from rank 0's partner copy on node0
        shutil.rmtree(os.path.join(tmp, "node1"))
    get_comm().barrier()
    tier = LocalTier(options(tmp, ranks_per_node=1))
    point = tier.recoverable()
    template = state(False)
    with _address_space(28 << 20, on=rank == 0):  # rank 0 cannot map the 64 MiB it sends
        failed = _outcome(lambda: tier.load(template, point))
    again = None
    if _in_step({0: failed}):
        again = _outcome(lambda: torch.equal(tier.load(state(False), point)["w"], state(True)["w"].data))
    tier.close()
    return failed, again


@pytest.mark.tiers
def test_a_partner_that_cannot_send_fails_the_recovery_on_every_rank_alike(tmp_path):
    results = run_distributed(_recover_with_a_sender_short_of_memory, 2, str(tmp_path), timeout_s=GROUP_TIMEOUT_S)
    (kind, message), again = results[0]
    assert results[1] == ((kind, message), again), results
    assert kind == "CheckpointingError", (kind, message)
    assert "transferring the local copies failed: rank 0: local tier: mapping" in message, message
    assert os.path.join("node0", "step_000000010", "data", "rank_00001") in message, message
    assert "Cannot allocate memory" in message, message
    assert again == ("ok", True), results  # still in step: the next recovery (with memory) completes


def _ingest_short_of_memory(rank, world):
    from lightning_distckpt.ingest.api import broadcast_and_shard_state_dict, shard_broadcasted_state_dict

    entries = {"w": ldc.ShardedTensor.from_rank_offsets("w", torch.empty(N, N, device="meta"), replica_id=rank)}
    source = {"w": _full(0)} if rank == 0 else None

    def shard():
        out = {}
        if rank == 0:
            broadcast_and_shard_state_dict(source, entries, out)
        else:
            shard_broadcasted_state_dict(entries, out)
        return torch.equal(out["w"], _full(0))

    warm = _outcome(shard)
    with _address_space(28 << 20, on=rank == 1):  # rank 1 cannot receive the 64 MiB broadcast
        short = _outcome(shard)
    again = _outcome(shard) if _in_step({0: short}) else None
    return warm, short, again


def test_a_rank_without_memory_for_rank_0s_broadcast_fails_every_rank_alike():
    results = run_distributed(_ingest_short_of_memory, 2, timeout_s=GROUP_TIMEOUT_S)
    assert results[0] == results[1], results
    warm, (kind, message), again = results[0]
    assert warm == again == ("ok", True), results  # still in step afterwards
    assert kind == "CheckpointingError", (kind, message)
    assert "rank 1: allocating 64.0 MiB on cpu for the broadcast of 'w' failed" in message, message
