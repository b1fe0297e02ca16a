"""The node-local tier on 4 gloo ranks as 2 simulated nodes of 2: local saves with partner copies,
agreement on the newest recoverable step, bit-exact recovery from partner copies when a node's
directory is lost, fallback to the durable checkpoint when both copies of a store are gone, pruning."""

import os
import shutil

import pytest

import lightning_distckpt as ldc
from dist_utils import run_distributed
from lightning_distckpt.tiers import LocalTier, RecoveryPoint
from tier_helpers import check_loaded, options, state

pytestmark = pytest.mark.tiers


def _small_pieces():
    """Transfers cut into many pieces and rounds (the bounded-memory path of every store's transfer)."""
    from lightning_distckpt.tiers import transfer

    transfer.PIECE_BYTES, transfer.ROUND_BYTES = 1000, 2500


def _save_steps(rank, world, tmp, steps, durable_at=(), small_pieces=False, kw=None, begin=()):
    if small_pieces:
        _small_pieces()
    tier = LocalTier(options(tmp, **(kw or {})))
    for step in steps:
        if step in begin:  # as TierCheckpoint: room made while the tree is built
            tier.begin(begin[step])
        sd = state(rank, world, step)
        tier.save(sd, step)
        sd["w"].data.add_(1e6)  # the training goes on at once: the save holds its own snapshot
        if step in durable_at:
            ldc.save(state(rank, world, step), os.path.join(tmp, f"durable_{step}"))
    tier.wait()
    point = tier.recoverable()
    tier.close()
    return point, tier.node, tier.root


def _recover(rank, world, tmp, durable=(), objects=True, small_pieces=False, load_kwargs=None):
    if small_pieces:
        _small_pieces()
    tier = LocalTier(options(tmp))
    point = tier.recoverable(durable)
    out = None
    if point is not None:
        out = tier.load(state(rank, world, 0, template=True, objects=objects), point, **(load_kwargs or {}))
        check_loaded(out, rank, world, point.step, objects=objects)
    tier.close()
    return point


def _held(root, step):
    """rank -> copy? of the stores a node's step directory notes as held."""
    from lightning_distckpt.tiers.node_store import read_notes, step_dir

    return {r: n["copy"] for r, n in read_notes(step_dir(root, step)).items()}


# begin: step -> the step begin() is called with before that step's save (another step: save makes room itself)
@pytest.mark.parametrize("begin", [{}, {10: 10, 20: 20, 30: 30}, {20: 20, 30: 25}], ids=["save", "begin", "mixed"])
def test_save_replicate_prune_and_agree(tmp_path, begin):
    tmp = str(tmp_path)
    results = run_distributed(_save_steps, 4, tmp, [10, 20, 30], (), False, None, begin)
    assert {r[0] for r in results} == {RecoveryPoint(30, "local")}
    assert [r[1] for r in results] == ["node0", "node0", "node1", "node1"]
    for node, own, copies in (("node0", {0, 1}, {2, 3}), ("node1", {2, 3}, {0, 1})):
        root = os.path.join(tmp, node)
        assert sorted(os.listdir(root)) == ["step_000000020", "step_000000030"]  # keep_local=2
        held = _held(root, 30)
        assert {r for r, c in held.items() if not c} == own and {r for r, c in held.items() if c} == copies


def _save_with_reserved_staging(rank, world, tmp):
    """Step 10 by one tier (its snapshot's size noted), 20 and 30 by a second one that reserved that
    much before its first save (the pool the save then copies into, faulted in by a thread)."""
    first = LocalTier(options(tmp))
    first.save(state(rank, world, 10), 10)
    first.close()
    nbytes = first._saver.staging_bytes
    tier = LocalTier(options(tmp))
    tier.reserve_staging(nbytes)
    assert tier._saver.staging_bytes == nbytes
    for step in (20, 30):
        sd = state(rank, world, step)
        tier.save(sd, step)
        sd["w"].data.add_(1e6)
        assert tier._saver.staging_bytes == nbytes  # the reserved pool, not a new one
    tier.close()


def test_reserved_snapshot_memory_saves_exactly(tmp_path):
    tmp = str(tmp_path)
    run_distributed(_save_with_reserved_staging, 4, tmp)
    shutil.rmtree(os.path.join(tmp, "node0"))
    assert set(run_distributed(_recover, 4, tmp)) == {RecoveryPoint(30, "local")}  # bit-exact (check_loaded)


@pytest.mark.parametrize("lost,small_pieces", [("node0", False), ("node1", True)])
def test_node_lost_recovers_bit_exact_from_partner_copies(tmp_path, lost, small_pieces):
    tmp = str(tmp_path)
    run_distributed(_save_steps, 4, tmp, [10, 20, 30], (), small_pieces)
    shutil.rmtree(os.path.join(tmp, lost))
    points = run_distributed(_recover, 4, tmp, (), True, small_pieces)
    assert set(points) == {RecoveryPoint(30, "local")}
    held = _held(os.path.join(tmp, lost), 30)  # the lost node's directory is back, with the stores its ranks read
    own = {0, 1} if lost == "node0" else {2, 3}
    assert held == {r: True for r in own | {0}}  # "b" is read from its main replica's writer, rank 0


def test_both_copies_lost_falls_back_to_durable(tmp_path):
    tmp = str(tmp_path)
    run_distributed(_save_steps, 4, tmp, [10, 20, 30], (20,))
    shutil.rmtree(os.path.join(tmp, "node1"))
    for step in (20, 30):  # rank 2's store: its own copy went with node1, the partner copy goes now
        shutil.rmtree(os.path.join(tmp, "node0", f"step_{step:09d}", "data", "rank_00002"))
    durable = [(20, os.path.join(tmp, "durable_20"))]
    points = run_distributed(_recover, 4, tmp, durable)
    assert set(points) == {RecoveryPoint(20, "durable", durable[0][1])}
    assert run_distributed(_recover, 4, tmp) == [None] * 4  # nothing local, no durable given


def test_durable_newer_than_local_wins(tmp_path):
    tmp = str(tmp_path)
    run_distributed(_save_steps, 4, tmp, [10, 20], (20,))
    durable = [(20, os.path.join(tmp, "durable_20")), (40, os.path.join(tmp, "missing_40"))]
    assert set(run_distributed(_recover, 4, tmp, durable)) == {RecoveryPoint(20, "local")}  # local wins a tie
    run_distributed(_save_steps, 4, tmp, [10])  # a restarted job's step 10: the abandoned run's newer steps go
    for node in ("node0", "node1"):
        assert sorted(os.listdir(os.path.join(tmp, node))) == ["step_000000010"]


def test_world_shrinks_to_one_node(tmp_path):
    tmp = str(tmp_path)
    run_distributed(_save_steps, 4, tmp, [10, 20])
    shutil.rmtree(os.path.join(tmp, "node1"))
    points = run_distributed(_recover, 2, tmp, (), False)  # 2 ranks, new split of "w"
    assert set(points) == {RecoveryPoint(20, "local")}


def test_keep_local_one_and_no_replicas(tmp_path):
    """keep_local=1 keeps one step per node; replicas=0 sends no copies, so a lost node loses its stores."""
    tmp = str(tmp_path)
    run_distributed(_save_steps, 4, tmp, [10, 20], (), False, {"keep_local": 1, "replicas": 0})
    for node, own in (("node0", {0, 1}), ("node1", {2, 3})):
        assert sorted(os.listdir(os.path.join(tmp, node))) == ["step_000000020"]
        assert _held(os.path.join(tmp, node), 20) == {r: False for r in own}
    shutil.rmtree(os.path.join(tmp, "node0"))
    assert run_distributed(_recover, 4, tmp) == [None] * 4


def _three_copies(rank, world, tmp):
    tier = LocalTier(options(tmp, replicas=3))  # 2 nodes: one partner copy kept, with a warning
    tier.save(state(rank, world, 10), 10)
    tier.close()


def test_more_replicas_than_other_nodes_keeps_one_per_node(tmp_path):
    tmp = str(tmp_path)
    run_distributed(_three_copies, 4, tmp)
    assert _held(os.path.join(tmp, "node0"), 10) == {0: False, 1: False, 2: True, 3: True}


def test_three_nodes_fetch_only_the_stores_read(tmp_path):
    """6 ranks as 3 nodes: a lost node fetches only the stores its ranks' loads read (its own rows, the
    replicated "b" from rank 0's store); with an exchange loader, which may read for other ranks, all."""
    tmp = str(tmp_path)
    run_distributed(_save_steps, 6, tmp, [10, 20])
    lost = os.path.join(tmp, "node2")
    shutil.rmtree(lost)
    assert set(run_distributed(_recover, 6, tmp)) == {RecoveryPoint(20, "local")}
    assert _held(lost, 20) == {0: True, 4: True, 5: True}
    shutil.rmtree(lost)
    results = run_distributed(_recover, 6, tmp, (), True, False, {"loader": "two_stage"})
    assert set(results) == {RecoveryPoint(20, "local")}
    assert _held(lost, 20) == {r: True for r in range(6)}
