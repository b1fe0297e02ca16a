"""A damaged local copy (a flipped byte in a chunk of a node-local store) is never used: on 4 gloo ranks as
2 simulated nodes, the recovery's load fails its checksum on the damaged node's ranks, every rank agrees
on the damaged stores, and the load is retried from the partner's copy of the same step, else the newest
older local step, else the durable checkpoint; the state loaded is bit-exact, a WARNING names the damaged
store, and its held-note is gone (a later recovery does not count it)."""

import logging
import os
import shutil

import pytest
import torch

import lightning_distckpt as ldc
from dist_utils import run_distributed
from lightning_distckpt.tiers import LocalTier, RecoveryPoint
from tier_helpers import options

pytestmark = pytest.mark.tiers

ROWS, COLS = 256, 64  # 16 KiB of float32 per rank: the middle of a store's data file is chunk bytes


def _full(step):
    return torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS) + step * 1e5


def _state(rank, world, step, template=False):
    rows = ROWS // world
    w = torch.zeros(rows, COLS) if template else _full(step)[rank * rows:(rank + 1) * rows].clone()
    return {"w": ldc.ShardedTensor.from_rank_offsets("w", w, (0, rank, world)), "step": -1 if template else step}


def _save(rank, world, tmp, durable_at=()):
    tier = LocalTier(options(tmp))
    for step in (10, 20, 30):
        tier.save(_state(rank, world, step), step)
        if step in durable_at:
            ldc.save(_state(rank, world, step), os.path.join(tmp, f"durable_{step}"))
    tier.close()


class _Collect(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _recover(rank, world, tmp, durable=()):
    handler = _Collect()
    logging.getLogger("lightning_distckpt.tiers").addHandler(handler)
    tier = LocalTier(options(tmp))
    point = tier.recoverable(durable)
    out = tier.load(_state(rank, world, 0, template=True), point)
    loaded = tier.last_point
    rows = ROWS // world
    assert torch.equal(out["w"], _full(loaded.step)[rank * rows:(rank + 1) * rows]), (rank, loaded)
    assert out["step"] == loaded.step
    tier.close()
    return point, loaded, handler.messages


def _flip(tmp, node, step, writer):
    """Flip one byte in the middle of the largest data file of ``writer``'s store in ``node``'s ``step``."""
    store = os.path.join(tmp, node, f"step_{step:09d}", "data", f"rank_{writer:05d}")
    files = [os.path.join(d, f) for d, _, fs in os.walk(store) for f in fs]
    path = max(files, key=os.path.getsize)
    raw = bytearray(open(path, "rb").read())
    raw[len(raw) // 2] ^= 0x5A
    open(path, "wb").write(bytes(raw))


def _noted(tmp, node, step):
    from lightning_distckpt.tiers.node_store import read_notes

    return read_notes(os.path.join(tmp, node, f"step_{step:09d}"))


def test_damaged_own_copy_falls_back_to_the_partner_copy(tmp_path):
    tmp = str(tmp_path)
    run_distributed(_save, 4, tmp)
    _flip(tmp, "node0", 30, 0)
    results = run_distributed(_recover, 4, tmp)
    assert {(p, q) for p, q, _ in results} == {(RecoveryPoint(30, "local"), RecoveryPoint(30, "local"))}
    warned = [m for _, _, msgs in results for m in msgs if "is damaged" in m]
    assert warned and all("rank 0's store" in m and "node0" in m for m in warned), warned
    note = _noted(tmp, "node0", 30)[0]  # replaced by the copy fetched from node1
    assert note["copy"] and note["fetched"] and note["from"] == "node1"


def test_damaged_in_every_copy_falls_back_to_an_older_local_step(tmp_path):
    tmp = str(tmp_path)
    run_distributed(_save, 4, tmp)
    _flip(tmp, "node1", 30, 2)  # rank 2's own store
    _flip(tmp, "node0", 30, 2)  # and its partner copy
    results = run_distributed(_recover, 4, tmp)
    assert {(p, q) for p, q, _ in results} == {(RecoveryPoint(30, "local"), RecoveryPoint(20, "local"))}
    assert 2 not in _noted(tmp, "node0", 30) and 2 not in _noted(tmp, "node1", 30)
    # a later job lists step 30 as unrecoverable at once: it resumes from 20 without reading 30
    assert {p for p, _, _ in run_distributed(_recover, 4, tmp)} == {RecoveryPoint(20, "local")}


def test_damaged_in_every_local_step_falls_back_to_durable(tmp_path):
    tmp = str(tmp_path)
    run_distributed(_save, 4, tmp, (20,))
    for step in (20, 30):
        _flip(tmp, "node1", step, 3)
        _flip(tmp, "node0", step, 3)
    durable = [(20, os.path.join(tmp, "durable_20"))]
    results = run_distributed(_recover, 4, tmp, durable)
    expected = (RecoveryPoint(30, "local"), RecoveryPoint(20, "durable", durable[0][1]))
    assert {(p, q) for p, q, _ in results} == {expected}


def test_damaged_copy_fetched_by_a_lost_node_is_not_fetched_again(tmp_path):
    """node1 lost: its ranks fetch rank 2's store from node0's partner copy, which is damaged; the retry
    sets node0's copy aside too, and step 20 (whole on node0) is loaded."""
    tmp = str(tmp_path)
    run_distributed(_save, 4, tmp)
    shutil.rmtree(os.path.join(tmp, "node1"))
    _flip(tmp, "node0", 30, 2)
    results = run_distributed(_recover, 4, tmp)
    assert {(p, q) for p, q, _ in results} == {(RecoveryPoint(30, "local"), RecoveryPoint(20, "local"))}
    assert 2 not in _noted(tmp, "node0", 30)
    assert any("arrived damaged" in m for _, _, msgs in results for m in msgs)


def _recover_error(rank, world, tmp):
    tier = LocalTier(options(tmp))
    point = tier.recoverable()
    try:
        tier.load(_state(rank, world, 0, template=True), point)
    except ldc.IncompleteCheckpointError as e:
        return str(e)
    finally:
        tier.close()
    return None


def test_nothing_intact_is_the_same_error_on_every_rank(tmp_path):
    tmp = str(tmp_path)
    run_distributed(_save, 4, tmp)
    for step in (20, 30):
        _flip(tmp, "node1", step, 2)
        _flip(tmp, "node0", step, 2)
    errors = run_distributed(_recover_error, 4, tmp)
    assert errors[0] is not None and len(set(errors)) == 1, errors
    assert "damaged local copies" in errors[0]


X_ROWS = 4096  # "x": replicated, stored once by rank 0, unpacked (1 MiB: the middle of rank 0's data file)


def _two_part_state(rank, world, step, template=False):
    sd = _state(rank, world, step, template)
    x = torch.zeros(X_ROWS, COLS) if template else torch.arange(X_ROWS * COLS, dtype=torch.float32).reshape(
        X_ROWS, COLS) + step
    sd["x"] = ldc.ShardedTensor.from_rank_offsets("x", x, replica_id=rank)
    return sd


def _save_two_part(rank, world, tmp):
    tier = LocalTier(options(tmp))
    for step in (10, 20, 30):
        tier.save(_two_part_state(rank, world, step), step)
    tier.close()


def _restore_in_two_parts(rank, world, tmp):
    """A restore's two parts, as Lightning's: "w" first (node1 reads only its own stores), then "x" (read by
    every rank from rank 0's store: on node1 its partner copy, damaged)."""
    tier = LocalTier(options(tmp))
    point = tier.recoverable()
    full = _two_part_state(rank, world, 0, template=True)
    first = tier.load({"w": full["w"], "step": full["step"]}, point)
    try:
        second = tier.load({"x": full["x"]}, tier.last_point)  # the point the first part read
    except ldc.IncompleteCheckpointError as e:
        return point, str(e)
    finally:
        tier.close()
    expected = _two_part_state(rank, world, tier.last_point.step)
    assert torch.equal(first["w"], expected["w"].data) and torch.equal(second["x"], expected["x"].data)
    return point, tier.last_point


def test_damage_found_by_a_later_part_uses_another_copy_of_the_same_step(tmp_path):
    tmp = str(tmp_path)
    run_distributed(_save_two_part, 4, tmp)
    _flip(tmp, "node1", 30, 0)  # node1's partner copy of rank 0's store
    results = run_distributed(_restore_in_two_parts, 4, tmp)
    assert set(results) == {(RecoveryPoint(30, "local"), RecoveryPoint(30, "local"))}
    assert _noted(tmp, "node1", 30)[0]["fetched"]  # replaced by node0's copy


def test_damage_in_every_copy_found_by_a_later_part_is_an_error_not_another_step(tmp_path):
    tmp = str(tmp_path)
    run_distributed(_save_two_part, 4, tmp)
    _flip(tmp, "node1", 30, 0)
    _flip(tmp, "node0", 30, 0)
    results = run_distributed(_restore_in_two_parts, 4, tmp)
    assert {p for p, _ in results} == {RecoveryPoint(30, "local")}
    assert len({m for _, m in results}) == 1 and "already restored" in results[0][1], results
