"""TierOptions and RecoveryPoint refuse bad values naming the field; partner choice on simulated nodes;
LocalTier's argument errors are the same on every rank (no rank left waiting)."""

import pytest

from dist_utils import run_distributed
from lightning_distckpt.core.errors import ArgumentError, ArgumentTypeError, CheckpointingError
from lightning_distckpt.tiers import LocalTier, RecoveryPoint, TierOptions
from lightning_distckpt.tiers.nodes import NodeMap
from tier_helpers import options, state

pytestmark = pytest.mark.tiers


@pytest.mark.parametrize("kw,err,field", [
    ({"keep_local": 0}, ArgumentError, "keep_local"),
    ({"replicas": -1}, ArgumentError, "replicas"),
    ({"local_every_n_steps": 1.5}, ArgumentTypeError, "local_every_n_steps"),
    ({"ranks_per_node": True}, ArgumentTypeError, "ranks_per_node"),
    ({"node": "a/b"}, ArgumentError, "node"),
    ({"node": "n0", "ranks_per_node": 2}, ArgumentError, "ranks_per_node"),
    ({"max_staging_bytes": 0}, ArgumentError, "max_staging_bytes"),
])
def test_options_refuse_bad_values(kw, err, field):
    with pytest.raises(err, match=field):
        TierOptions(local_dir="/tmp/x", **kw)


@pytest.mark.parametrize("local_dir", ["", "s3://bucket/x", 3])
def test_options_refuse_bad_local_dir(local_dir):
    with pytest.raises(CheckpointingError, match="local_dir"):
        TierOptions(local_dir=local_dir)


def test_recovery_point_checks():
    with pytest.raises(ArgumentError, match="path"):
        RecoveryPoint(10, "durable")
    with pytest.raises(ArgumentError, match="source"):
        RecoveryPoint(10, "nvme")


def test_partners_are_on_other_nodes_and_spread():
    nodes = NodeMap(("a", "a", "b", "b", "c", "c"))
    assert [nodes.partners(r, 1) for r in range(6)] == [[2], [3], [4], [5], [0], [1]]
    assert nodes.partners(0, 2) == [2, 4] and nodes.sources(0, 2) == [2, 4]
    assert nodes.partners(0, 5) == [2, 4]  # at most one copy per other node
    uneven = NodeMap(("a", "a", "a", "b"))
    assert [uneven.partners(r, 1) for r in range(4)] == [[3], [3], [3], [0]]
    assert NodeMap(("a", "a")).partners(0, 1) == []


def _bad_calls(rank, world, tmp):
    tier = LocalTier(options(tmp))
    errors = []
    bad_durable = [(10, "x")] if rank else [("ten", "x")]  # only rank 0's is bad: still every rank raises
    try:
        tier.recoverable(bad_durable)
    except ArgumentError as e:
        errors.append(type(e).__name__)
    tier.save(state(rank, world, 10 + (rank == 3)), 10 + (rank == 3))  # rank 3 disagrees on the step
    try:
        tier.wait()
    except CheckpointingError as e:
        errors.append(type(e).__name__)
    tier.save(state(rank, world, 20), 20)  # the tier goes on after a failed save
    tier.wait()
    errors.append(tier.recoverable().step)
    return errors


def test_argument_errors_are_agreed(tmp_path):
    results = run_distributed(_bad_calls, 4, str(tmp_path))
    assert results == [["ArgumentError", "ArgumentError", 20]] * 4


def test_node_names_from_host_and_launcher():
    from lightning_distckpt.tiers.nodes import name_nodes

    # one launched node per host: the host name alone; given names win
    assert name_nodes([(None, "a", 0), (None, "a", 0), (None, "b", 2), ("x", "b", None)]) == ["a", "a", "b", "x"]
    # one host name for two launched nodes (containers, torchrun --nnodes 2 on one machine): split
    assert name_nodes([(None, "h", 0), (None, "h", 0), (None, "h", 2), (None, "h", 2)]) == ["h-0", "h-0", "h-2", "h-2"]
    # no launcher variables: the host name
    assert name_nodes([(None, "h", None), (None, "h", None)]) == ["h", "h"]


def _launched(rank, world, tmp, local_world_size):
    import os

    os.environ["LOCAL_WORLD_SIZE"] = str(local_world_size)
    os.environ["LOCAL_RANK"] = str(rank % 2) if local_world_size == 2 else "x"
    try:
        tier = LocalTier(TierOptions(local_dir=os.path.join(tmp, "{node}")))
    except ArgumentError as e:
        return str(e)
    tier.save(state(rank, world, 10), 10)
    tier.close()
    return tier.node


def test_launcher_variables_split_one_host_into_nodes(tmp_path):
    """4 processes on one host, launched as 2 nodes of 2 (LOCAL_RANK / LOCAL_WORLD_SIZE as torchrun sets
    them): two nodes, each with its own directory and the other's partner copies; a malformed variable
    is the same ArgumentError on every rank."""
    import os
    import socket

    from lightning_distckpt.tiers.node_store import read_notes

    host = socket.gethostname()
    names = run_distributed(_launched, 4, str(tmp_path), 2)
    assert names == [f"{host}-0", f"{host}-0", f"{host}-2", f"{host}-2"]
    notes = read_notes(os.path.join(str(tmp_path), f"{host}-0", "step_000000010"))
    assert {r: n["copy"] for r, n in notes.items()} == {0: False, 1: False, 2: True, 3: True}
    errors = run_distributed(_launched, 4, str(tmp_path / "bad"), 3)
    assert len(set(errors)) == 1 and "LOCAL_RANK" in errors[0]


def _shared_root(rank, world, tmp):
    try:
        LocalTier(TierOptions(local_dir=tmp, ranks_per_node=2))
    except ArgumentError as e:
        return str(e)
    return None


def test_simulated_nodes_sharing_one_directory_refused_on_every_rank(tmp_path):
    """Two simulated nodes of one host with a local_dir lacking {node}: the same ArgumentError on every
    rank (each rank's root computed from what all gathered), naming both nodes and the fix."""
    errors = run_distributed(_shared_root, 4, str(tmp_path))
    assert len(set(errors)) == 1 and errors[0] is not None
    assert "'node0' and 'node1'" in errors[0] and "{node}" in errors[0]
