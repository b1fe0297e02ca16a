"""Node roots holding what looks like the tier's own but is not, against the recovery.

Each case found a hole: a recovery that wrote through a link in a step directory (the partner store it
fetched replaced a directory outside, or its held-note overwrote a file outside), removed another
checkpoint's commit marker through a step directory that is a link, blocked for ever on a FIFO where a
note goes, checked one directory and read another (a step directory by another spelling of its name),
kept a damaged store counted as held (a second note by another spelling of its name), or set aside an
intact partner copy because a note said the damaged store had once been fetched from it.

Real files, real gloo ranks (2 simulated nodes of 1 rank: tier_helpers), one process where one suffices.
"""

import contextlib
import io
import os
import shutil

import pytest
import torch

import lightning_distckpt as ldc
from dist_utils import run_distributed
from lightning_distckpt.core.errors import CheckpointingError
from lightning_distckpt.tiers import LocalTier, RecoveryPoint, TierOptions
from lightning_distckpt.tiers.node_store import read_notes, write_note
from tiers.tier_helpers import check_loaded, options, state
from trust.hostile import run_bounded, snapshot

pytestmark = pytest.mark.tiers


def _save(rank, world, tmp):
    tier = LocalTier(options(tmp, ranks_per_node=1))
    tier.save(state(rank, world, 10), 10)
    tier.close()


def _recover(rank, world, tmp):
    """The point loaded (its state checked exactly), or the error's text."""
    tier = LocalTier(options(tmp, ranks_per_node=1))
    try:
        point = tier.recoverable()
        out = tier.load(state(rank, world, 0, template=True), point)
        check_loaded(out, rank, world, tier.last_point.step)
        return tier.last_point
    except CheckpointingError as e:
        return f"{type(e).__name__}: {e}"
    finally:
        tier.close()


def _step(tmp, node, step=10):
    return os.path.join(tmp, node, f"step_{step:09d}")


def _outside(tmp):
    """A directory that is not the tier's, shaped like a step's data/ (rank_00000/, rank_00001/)."""
    out = os.path.join(tmp, "outside")
    for w in (0, 1):
        os.makedirs(os.path.join(out, f"rank_{w:05d}"))
        with open(os.path.join(out, f"rank_{w:05d}", "theirs.txt"), "w") as f:
            f.write("not the tier's")
    with open(os.path.join(out, "secret"), "w") as f:
        f.write("not the tier's")
    return out


def test_a_data_link_in_a_step_directory_is_never_written_through(tmp_path):
    """node1's step directory has data/ as a link: the fetch used to rmtree rank_00000/ there and move
    the received stores in; now the directory fails its checks and node1 gets a whole copy from node0."""
    tmp = str(tmp_path)
    run_distributed(_save, 2, tmp)
    outside = _outside(tmp)
    before = snapshot(outside)
    data = os.path.join(_step(tmp, "node1"), "data")
    shutil.rmtree(data)
    os.symlink(outside, data)
    assert run_distributed(_recover, 2, tmp) == [RecoveryPoint(10, "local")] * 2
    assert snapshot(outside) == before
    assert not os.path.islink(data)  # node1's directory replaced by the fetched copy


def test_a_note_that_is_a_link_is_replaced_not_written_through(tmp_path):
    """node1's note of rank 0's copy is a link to a file outside: not counted, so rank 0's store is fetched
    again; its new note used to be written into the file the link names."""
    tmp = str(tmp_path)
    run_distributed(_save, 2, tmp)
    outside = _outside(tmp)
    before = snapshot(outside)
    note = os.path.join(_step(tmp, "node1"), "local_tier", "held_rank_00000.json")
    os.remove(note)
    os.symlink(os.path.join(outside, "secret"), note)
    assert run_distributed(_recover, 2, tmp) == [RecoveryPoint(10, "local")] * 2
    assert snapshot(outside) == before
    assert not os.path.islink(note) and read_notes(_step(tmp, "node1"))[0]["fetched"]


def test_a_note_that_is_a_fifo_is_replaced_without_blocking(tmp_path):
    """Writing a note where a FIFO has its name used to open the FIFO and wait for a reader for ever."""
    step = tmp_path / "step_000000010"
    (step / "local_tier").mkdir(parents=True)
    fifo = str(step / "local_tier" / "held_rank_00003.json")
    os.mkfifo(fifo)

    def unblock():  # a regression's blocked open ends once a reader comes
        fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
        os.close(fd)

    out = run_bounded(lambda: write_note(str(step), 3, copy=True, node="node0", fetched=True), 10, unblock)
    assert "error" not in out, out
    assert read_notes(str(step))[3] == {"rank": 3, "copy": True, "from": "node0", "fetched": True}
    assert os.listdir(step / "local_tier") == ["held_rank_00003.json"]  # no temporary file left


def test_a_linked_step_directory_keeps_its_targets_commit_marker(tmp_path):
    """node1's step directory is a link to another job's committed step: the fetch that completes node1
    used to remove the marker through the link before refusing; now only the refusal, naming the path."""
    tmp = str(tmp_path)
    run_distributed(_save, 2, tmp)
    other = os.path.join(tmp, "other_job", "step_000000010")
    shutil.copytree(_step(tmp, "node1"), other)
    shutil.rmtree(_step(tmp, "node1"))
    os.symlink(other, _step(tmp, "node1"))
    before = snapshot(other)
    errors = run_distributed(_recover, 2, tmp)
    assert len(set(errors)) == 1 and "is in the way" in errors[0] and _step(tmp, "node1") in errors[0], errors
    assert snapshot(other) == before


def _flip(path):
    raw = bytearray(open(path, "rb").read())
    raw[len(raw) // 2] ^= 0x5A
    open(path, "wb").write(bytes(raw))


def _largest_file(store):
    return max((os.path.join(d, f) for d, _, fs in os.walk(store) for f in fs), key=os.path.getsize)


def test_a_damaged_store_once_fetched_keeps_its_intact_source(tmp_path):
    """node0's store of rank 0 is damaged and its note says an earlier recovery fetched it from node1
    (it is kept across jobs): node1's intact copy used to be set aside unread, leaving step 10
    unrecoverable; now it is checked, kept, and the load reads it."""
    tmp = str(tmp_path)
    run_distributed(_save, 2, tmp)
    write_note(_step(tmp, "node0"), 0, copy=True, node="node1", fetched=True)
    _flip(_largest_file(os.path.join(_step(tmp, "node0"), "data", "rank_00000")))
    assert run_distributed(_recover, 2, tmp) == [RecoveryPoint(10, "local")] * 2
    assert 0 in read_notes(_step(tmp, "node1"))


def _one(step, template=False):
    w = torch.zeros(64) if template else torch.arange(64.0) + step
    return {"w": ldc.ShardedTensor.from_rank_offsets("w", w), "step": -1 if template else step}


def _one_rank_root(tmp_path, steps):
    root = str(tmp_path / "root")
    tier = LocalTier(TierOptions(local_dir=root, keep_local=3))
    for step in steps:
        tier.save(_one(step), step)
    tier.close()
    return root


def _recover_one(root):
    tier = LocalTier(TierOptions(local_dir=root, keep_local=3))
    try:
        point = tier.recoverable()
        out = tier.load(_one(0, template=True), point)
        return tier.last_point, out
    finally:
        tier.close()


@pytest.mark.parametrize("name", ["step_0000000020", "step_" + "\u0660" * 7 + "\u0662\u0660"])
def test_a_step_directory_by_another_spelling_is_not_a_step(tmp_path, name):
    """A copy of step 10's directory named like step 20 but not as the tier names it (ten digits,
    Arabic-Indic digits): it used to be listed as step 20, then the load read step_000000020 (absent,
    made by the fetch) and failed instead of recovering step 10."""
    root = _one_rank_root(tmp_path, (10,))
    shutil.copytree(os.path.join(root, "step_000000010"), os.path.join(root, name))
    point, out = _recover_one(root)
    assert point == RecoveryPoint(10, "local") and torch.equal(out["w"], _one(10)["w"].data)
    assert not os.path.exists(os.path.join(root, "step_000000020"))
    from lightning_distckpt.cli.main import main

    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        assert main(["inspect", root]) == 0
    assert "step 20" not in text.getvalue() and "step 10" in text.getvalue()


def test_a_second_note_by_another_spelling_does_not_keep_a_damaged_store(tmp_path):
    """Step 20's store is damaged and has a second held-note (held_rank_000000.json): dropping the note
    the tier writes used to leave it counted as held, so the recovery failed instead of loading step 10."""
    root = _one_rank_root(tmp_path, (10, 20))
    step20 = os.path.join(root, "step_000000020")
    notes = os.path.join(step20, "local_tier")
    shutil.copy(os.path.join(notes, "held_rank_00000.json"), os.path.join(notes, "held_rank_000000.json"))
    _flip(_largest_file(os.path.join(step20, "data", "rank_00000")))
    point, out = _recover_one(root)
    assert point == RecoveryPoint(10, "local") and torch.equal(out["w"], _one(10)["w"].data)


def _recoverable(rank, world, tmp):
    tier = LocalTier(options(tmp, ranks_per_node=1))
    try:
        return tier.recoverable()
    finally:
        tier.close()


def test_a_partner_copy_holding_a_huge_sparse_file_is_not_counted_as_held(tmp_path):
    """node0 is lost; node1's copy of rank 0's store holds a sparse 100 GB zarr.json (nothing on disk).
    Counted as held, the recovery sent it whole over gloo to node0; now each file of a held store is
    checked against what the index says the store holds (as a load checks it), so that copy is not
    held, rank 0's store is held nowhere, and step 10 is not recoverable."""
    tmp = str(tmp_path)
    run_distributed(_save, 2, tmp)
    shutil.rmtree(os.path.join(tmp, "node0"))
    store = os.path.join(_step(tmp, "node1"), "data", "rank_00000")
    with open(os.path.join(store, "zarr.json"), "wb") as f:
        f.truncate(100 << 30)
    assert run_distributed(_recoverable, 2, tmp) == [None, None]


def test_clean_sizing_a_leftover_that_a_recovery_just_removed_skips_it(tmp_path):
    """``clean`` lists a node root's leftovers, then sizes each; a recovery running beside it renames its
    transfers into place and removes torn steps in between. A leftover gone by then is skipped (it was
    a raw FileNotFoundError out of the command); one still there is sized as before."""
    from lightning_distckpt.tiers.views import _size_and_idle

    assert _size_and_idle(str(tmp_path / "gone")) is None
    kept = tmp_path / "kept" / "sub"
    kept.mkdir(parents=True)
    (kept / "a").write_bytes(b"x" * 10)
    nbytes, idle = _size_and_idle(str(tmp_path / "kept"))
    assert nbytes == 10 and idle >= 0


def test_a_partner_copy_whose_data_file_is_a_huge_sparse_file_is_not_counted_as_held(tmp_path):
    """The same with the bytes in a file no per-file cap covers (an OCDBT data file, read by a load only in
    the ranges its index names, but sent whole by a transfer): a store holding more than a save of its
    index writes (tensors, objects at their cap, slack) is not held."""
    tmp = str(tmp_path)
    run_distributed(_save, 2, tmp)
    shutil.rmtree(os.path.join(tmp, "node0"))
    store = os.path.join(_step(tmp, "node1"), "data", "rank_00000")
    with open(os.path.join(store, "d", "padding"), "wb") as f:
        f.truncate(100 << 30)
    assert run_distributed(_recoverable, 2, tmp) == [None, None]
