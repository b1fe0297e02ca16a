"""Two jobs (or a job and a person) on one checkpoint folder at the same time: what a red-team probe found.

Each case runs the jobs as real processes; the interleaving is made exact by wrapping, inside a job's own
script, the library function at the point of interest so that it marks a file and waits for the other
job's mark (a hang guard bounds each wait; no timing is relied on).

* **Two jobs given one node-local tier directory** (two experiments from one config, a requeued job's new
  incarnation while the old one still runs): the second job's tier pruned the first's steps and, asked
  what to recover, named the first job's newest step, whose values (another model's, checksums right)
  it then loaded. Now a node root is one job's at a time: the second job's ``LocalTier`` is an
  ``ArgumentError`` on every rank naming the directory and the process holding it; a second tier of
  the same process (a second Trainer in the script) shares it, and it is free once the job ends.
* **``save_last="link"`` while another job resumes from ``"last"`` or links too**: Lightning removes
  ``last.ckpt`` and links after, so between the two another job's ``ckpt_path="last"`` found no last
  checkpoint (and started from scratch), and a second job linking then made the first job's link fail
  and its fallback copy a directory (``IsADirectoryError``: training crashed). ``DistModelCheckpoint``
  now links in one rename.
* **A load while a save replaces the same checkpoint** (``ckpt_path="last"``, ``convert``, ``validate``
  while training saves): a save committing between the load's reads of ``COMMITTED`` and
  ``metadata.json`` made the load fail with "checksum mismatch ... damaged"; one committing after the
  open, with "written by another save ... a rank store copied in from another checkpoint" or "claims N
  bytes ... damaged metadata or lost data" or a damaged ``common.pt``. Now the pair is read again (the
  load succeeds with the newer checkpoint, whole), and a replacement later on is said to be one
  ("replaced while being read ... load it again"), a ``CheckpointingError`` that is not a
  ``FormatError`` (damage).
* **Two jobs saving one name at once**: found sound (the later commit wins whole, both saves succeed,
  nothing is left behind, with and without ``RENAME_EXCHANGE``), but silent: a save now warns, naming the
  other process, when another save of the same name is writing on this host.
* **``save_last="link"`` over a directory**: Lightning removed any directory at ``last.ckpt``; now only a
  checkpoint (or an empty directory) is replaced, anything else is refused and kept.
"""

import json
import os

import pytest
import torch
from dist_utils import free_port
from script_ranks import read_log, script_env, start_script, stop_all

import lightning_distckpt as ldc
from lightning_distckpt.core.errors import CheckpointingError
from lightning_distckpt.storage.commit import NO_EXCHANGE_ENV
from lightning_distckpt.storage.staging import is_staging_dir

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
N = 4096

# What every job script starts with: marks (files in the test's folder) and waits for the other job's.
PREAMBLE = r'''
import json, os, sys, time
sys.path.insert(0, TESTS)
marks = sys.argv[1]
rank, world = int(os.environ["JOB_RANK"]), int(os.environ["JOB_WORLD"])
if world > 1:  # a job of several ranks: a gloo group of its own
    import datetime
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{os.environ['JOB_PORT']}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=30))


def mark(name):
    open(os.path.join(marks, name), "w").close()


def wait_for(name):  # a hang guard only: the other job marks it as soon as it is there
    deadline = time.monotonic() + 120
    while not os.path.exists(os.path.join(marks, name)):
        assert time.monotonic() < deadline, name
        time.sleep(0.005)


def report(name, result):
    with open(os.path.join(marks, f"{name}.rank{rank}.json"), "w") as f:
        json.dump(result, f)
'''.replace("TESTS", repr(TESTS))


def _run_jobs(tmp_path, jobs, timeout=180):
    """Start each ``(name, script text, args[, ranks])`` as processes of its own (one per rank) at once;
    wait for all; return each job's report (its ranks': a list where it has several), failing with the
    logs of any rank that wrote none."""
    marks = tmp_path / "marks"
    marks.mkdir()
    procs, ranks = [], []
    for name, text, args, *world in jobs:
        world = world[0] if world else 1
        script = tmp_path / f"{name}.py"
        script.write_text(PREAMBLE + text)
        env = {**script_env(), "JOB_WORLD": str(world), "JOB_PORT": str(free_port())}
        for rank in range(world):
            log = str(tmp_path / f"{name}.rank{rank}.log")
            procs.append(start_script(str(script), [str(marks), *map(str, args)], {**env, "JOB_RANK": str(rank)}, log))
            ranks.append((name, rank, world, log))
    try:
        for p in procs:
            p.join(timeout)  # a failure bound, not a schedule
    finally:
        stop_all(procs)
    out = {}
    for name, rank, world, log in ranks:
        path = marks / f"{name}.rank{rank}.json"
        assert path.is_file(), f"job {name} rank {rank} reported nothing:\n{read_log(log)[-4000:]}"
        result = json.loads(path.read_text())
        out[name] = result if world == 1 else [*out.get(name, []), result]
    return out


def _state(value, template=False):
    w = torch.zeros(N) if template else torch.full((N,), float(value))
    return {"w": ldc.ShardedTensor.from_rank_offsets("w", w), "step": -1 if template else int(value)}


# -- two jobs, one node-local tier directory ---------------------------------------------------------------
TIER_JOB_A = r'''
from lightning_distckpt.tiers import LocalTier, TierOptions
from tiers.tier_helpers import state
tier = LocalTier(TierOptions(local_dir=sys.argv[2], keep_local=2))
tier.save(state(0, 1, 100, objects=False), 100)
tier.wait()
second = LocalTier(TierOptions(local_dir=sys.argv[2], keep_local=2))  # a second Trainer of the same script
mark("a_saved")
wait_for("b_done")
point = second.recoverable()  # before: none (job B had pruned step 100)
report("a", {"pid": os.getpid(), "recovers": point.step if point is not None else None})
'''

TIER_JOB_B = r'''
from lightning_distckpt.tiers import LocalTier, TierOptions
from tiers.tier_helpers import state
wait_for("a_saved")
try:
    tier = LocalTier(TierOptions(local_dir=sys.argv[2], keep_local=2))
    point = tier.recoverable()  # what a restart of job B would resume from
    out = tier.load(state(rank, world, 0, template=True, objects=False), point)
    result = {"recovered": point.step, "values_of_step": float(out["b"][0])}
    tier.save(state(rank, world, 10, objects=False), 10)
    tier.close()
except Exception as e:
    result = {"error": f"{type(e).__name__}: {e}"}
if rank == 0:
    mark("b_done")
report("b", result)
'''


def test_a_second_job_on_the_same_node_local_directory_is_refused(tmp_path):
    root = tmp_path / "local"
    out = _run_jobs(tmp_path, [("a", TIER_JOB_A, [root]), ("b", TIER_JOB_B, [root], 2)])
    # before: job B recovered job A's step 100 (A's values) as its own, then its save pruned A's steps
    for b in out["b"]:  # both ranks of job B (one node: its lead, rank 0, found the directory held)
        assert "error" in b, out["b"]
        assert "ArgumentError" in b["error"] and str(root) in b["error"]
        assert "in use by another job" in b["error"] and f"pid {out['a']['pid']}" in b["error"]
    assert out["a"]["recovers"] == 100  # job A's own step, untouched
    # (the root's lock file stays where its holder ended without closing its tiers: no step, held by no one)
    assert sorted(set(os.listdir(root)) - {".ldc-tier-root.lock"}) == ["step_000000100"]
    # job A has ended: the directory is free (a requeued job's next incarnation takes it up)
    from lightning_distckpt.tiers import LocalTier, TierOptions

    tier = LocalTier(TierOptions(local_dir=str(root), keep_local=2))
    try:
        assert tier.recoverable().step == 100
    finally:
        tier.close()


# -- save_last="link" while another job resumes from "last" and links too ------------------------------------
# Job A: two steps, a checkpoint each, save_last="link"; its second link is held (os.symlink wrapped, in A's
# process only) until job B has looked for "last" and run its own one-step fit into the same folder.
LINK_FIT = r'''
from lightning.pytorch import Trainer
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning_distckpt.lightning import DistCheckpointIO, DistModelCheckpoint


def fit(folder, steps):
    Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_progress_bar=False,
            enable_model_summary=False, enable_checkpointing=True, plugins=[DistCheckpointIO()],
            callbacks=[DistModelCheckpoint(folder, filename="{step}", every_n_train_steps=1,
                                           save_last="link")]).fit(BoringModel())


folder = sys.argv[2]
'''

LINK_JOB_A = LINK_FIT + r'''
real_symlink, calls = os.symlink, []


def held_symlink(src, dst, *args, **kwargs):
    if "last" in os.path.basename(dst):
        calls.append(dst)
        if len(calls) == 2:  # step 2's link: last.ckpt names step 1's checkpoint until it is made
            mark("a_linking")
            wait_for("b_done")
    return real_symlink(src, dst, *args, **kwargs)


os.symlink = held_symlink
try:
    fit(folder, 2)
    result = {"fit": "finished"}
except Exception as e:
    result = {"fit": f"{type(e).__name__}: {e}"}
report("a", result)
'''

LINK_JOB_B = LINK_FIT + r'''
wait_for("a_linking")
seen = os.path.lexists(os.path.join(folder, "last.ckpt"))  # what ckpt_path="last" would find now
try:
    fit(folder, 1)
    result = {"fit": "finished"}
except Exception as e:
    result = {"fit": f"{type(e).__name__}: {e}"}
mark("b_done")
report("b", dict(result, last_seen=seen))
'''


def test_linking_last_never_leaves_it_missing_nor_fails_a_second_job(tmp_path):
    folder = tmp_path / "ck"
    out = _run_jobs(tmp_path, [("a", LINK_JOB_A, [folder]), ("b", LINK_JOB_B, [folder])])
    # before: last.ckpt was gone while job A relinked it, and job A's fit failed (IsADirectoryError)
    assert out["b"]["last_seen"], "last.ckpt was missing while another job relinked it"
    assert out["a"]["fit"] == "finished" and out["b"]["fit"] == "finished", out
    for name in ("last.ckpt", "last-v1.ckpt"):  # job B found last.ckpt taken: its own is last-v1.ckpt
        link = folder / name
        assert link.is_symlink(), sorted(os.listdir(folder))
        step = ldc.load_common_state_dict(str(link))["global_step"]
        assert step == (2 if name == "last.ckpt" else 1)
    assert not [n for n in os.listdir(folder) if n.startswith(".")]  # no temporary link left


# -- a load while a save replaces the same checkpoint --------------------------------------------------------
# The reader is held at a point of its load (the wrapped function, in its own process) until the writer,
# another job, has replaced the checkpoint with a save of other values.
READER = r'''
import torch
import lightning_distckpt as ldc
from lightning_distckpt.core.errors import FormatError
from lightning_distckpt.storage import layout, local_store

target, where, n = sys.argv[2], sys.argv[3], int(sys.argv[4])
if where == "between_marker_and_metadata":
    real_read = layout.read_inside

    def held_read(path, *args, **kwargs):
        out = real_read(path, *args, **kwargs)
        if path.endswith("COMMITTED") and not os.path.exists(os.path.join(marks, "r_held")):
            mark("r_held")
            wait_for("w_done")
        return out

    layout.read_inside = held_read
else:  # after the open, before anything else is read
    real_open = local_store.LocalStore.open_metadata

    def held_open(self):
        out = real_open(self)
        if not os.path.exists(os.path.join(marks, "r_held")):
            mark("r_held")
            wait_for("w_done")
        return out

    local_store.LocalStore.open_metadata = held_open
try:
    w = ldc.load({"w": ldc.ShardedTensor.from_rank_offsets("w", torch.zeros(n))}, target)["w"]
    common = ldc.load_common_state_dict(target)
    result = {"values": sorted(set(w.tolist())), "step": common["step"]}
except Exception as e:
    result = {"error": type(e).__name__, "damage": isinstance(e, FormatError), "message": str(e)}
report("r", result)
'''

WRITER = r'''
import torch
import lightning_distckpt as ldc
target, layout, n = sys.argv[2], sys.argv[3], int(sys.argv[4])
wait_for("r_held")
ldc.save({"w": ldc.ShardedTensor.from_rank_offsets("w", torch.full((n,), 2.0)), "step": 2}, target,
         storage=ldc.StorageOptions(layout=layout))
mark("w_done")
report("w", "saved")
'''


def _replaced_under_a_load(tmp_path, where, layout, old_n=N, new_n=N):
    target = tmp_path / "ck"
    ldc.save({"w": ldc.ShardedTensor.from_rank_offsets("w", torch.full((old_n,), 1.0)), "step": 1}, str(target),
             storage=ldc.StorageOptions(layout=layout))
    return _run_jobs(tmp_path, [("r", READER, [target, where, old_n]),
                                ("w", WRITER, [target, layout, new_n])])["r"]


def test_a_checkpoint_replaced_while_it_is_opened_is_read_again(tmp_path):
    out = _replaced_under_a_load(tmp_path, "between_marker_and_metadata", "ocdbt")
    # before: FormatError "metadata.json: checksum mismatch ... the file is damaged"
    assert out == {"values": [2.0], "step": 2}, out  # the newer checkpoint, whole


@pytest.mark.parametrize("layout,new_n", [("ocdbt", N), ("zarr", N), ("ocdbt", 64)],
                         ids=["ocdbt", "zarr", "smaller-save"])
def test_a_checkpoint_replaced_after_it_was_opened_is_not_called_damaged(tmp_path, layout, new_n):
    out = _replaced_under_a_load(tmp_path, "after_open", layout, new_n=new_n)
    # before: FormatError "written by another save ... a rank store copied in from another checkpoint", or
    # (a smaller save) "metadata.json claims ... bytes ... damaged metadata or lost data"
    assert out.get("error") == "CheckpointingError" and not out["damage"], out
    assert "replaced while being read" in out["message"] and "load it again" in out["message"], out
    if new_n == N:  # loaded again, it is the newer checkpoint, whole
        assert torch.equal(ldc.load(_state(0, template=True), str(tmp_path / "ck"))["w"], torch.full((N,), 2.0))


def test_common_state_replaced_after_the_open_is_not_called_damaged(tmp_path):
    """common.pt read from the newer save, checked against the marker the load opened: not damage."""
    from lightning_distckpt.reading.checkpoint import OpenedCheckpoint

    target = str(tmp_path / "ck")
    ldc.save(_state(1), target)
    opened = OpenedCheckpoint.open(target)
    ldc.save(_state(2), target)  # another job's save, committed after the open
    with pytest.raises(CheckpointingError, match="replaced while being read") as e:
        opened.load_common()
    assert not isinstance(e.value, ldc.FormatError)  # before: FormatError "common.pt: checksum mismatch"
    assert ldc.load_common_state_dict(target)["step"] == 2


# -- two jobs committing the same name at once ------------------------------------------------------------------
# Job A's commit is held (at its start, its owner notes still there; or after its marker is durable, just
# before its rename into place) until job B has saved the same name from start to end; then A goes on.
SAVE_JOB = r'''
import logging
import torch
import lightning_distckpt as ldc
from lightning_distckpt.storage import commit
target, value, hold, background = sys.argv[2], float(sys.argv[3]), sys.argv[4], sys.argv[5] == "async"
warnings = []


class Seen(logging.Handler):
    def emit(self, record):
        warnings.append(record.getMessage())


logging.getLogger("lightning_distckpt").addHandler(Seen(logging.WARNING))
if hold != "go":
    real = getattr(commit, hold)

    def held(*args, **kwargs):
        mark("a_committing")
        wait_for("b_done")
        return real(*args, **kwargs)

    setattr(commit, hold, held)
else:
    wait_for("a_committing")
try:
    request = ldc.save({"w": ldc.ShardedTensor.from_rank_offsets("w", torch.full((NUMEL,), value)),
                        "step": int(value)}, target, async_save=background)
    if request is not None:
        request.finalize()  # commits here: the hold is met in it
    result = "saved"
except Exception as e:
    result = f"{type(e).__name__}: {e}"
if hold == "go":
    mark("b_done")
report("a" if hold != "go" else "b", {"result": result, "pid": os.getpid(), "warnings": warnings})
'''.replace("NUMEL", str(N))


@pytest.mark.parametrize("hold,exchange,mode", [("commit", True, "sync"), ("_swap_in", True, "async"),
                                                ("_swap_in", False, "sync")],
                         ids=["writing", "renaming-async", "renaming-two-renames"])
def test_two_jobs_committing_one_name_at_once(tmp_path, monkeypatch, hold, exchange, mode):
    """The later commit wins whole, both saves succeed, nothing is left behind (sound before too); a save
    that starts while another job's save of the same name is writing says so, naming its pid (before:
    nothing was said)."""
    monkeypatch.setenv(NO_EXCHANGE_ENV, "0" if exchange else "1")  # the jobs inherit it
    target = tmp_path / "ck" / "step=10.ckpt"
    ldc.save(_state(1), str(target))
    out = _run_jobs(tmp_path, [("a", SAVE_JOB, [target, 3.0, hold, mode]), ("b", SAVE_JOB, [target, 2.0, "go", mode])])
    assert out["a"]["result"] == "saved" and out["b"]["result"] == "saved", out
    loaded = ldc.load(_state(0, template=True), str(target))
    assert torch.equal(loaded["w"], torch.full((N,), 3.0)) and loaded["step"] == 3  # the later commit, whole
    assert os.listdir(tmp_path / "ck") == ["step=10.ckpt"]  # nothing left behind
    assert not [n for n in os.listdir(target) if is_staging_dir(n) or n == ".writing"]
    if hold == "commit":
        running = [w for w in out["b"]["warnings"] if "another save to it is running" in w]
        assert running and f"pid {out['a']['pid']}" in running[0] and str(target) in running[0], out["b"]


# -- what save_last="link" finds at last.ckpt -------------------------------------------------------------------
@pytest.mark.parametrize("there,exchange", [("theirs", True), ("checkpoint", True), ("checkpoint", False)],
                         ids=["users-directory", "checkpoint", "checkpoint-two-renames"])
def test_linking_last_replaces_only_a_checkpoint(tmp_path, monkeypatch, there, exchange):
    """Lightning removed whatever directory was at last.ckpt (``shutil.rmtree``) before linking; a
    checkpoint there (``save_last=True`` of another run) is replaced, anything else is refused and kept."""
    from lightning.pytorch import Trainer

    from lightning_distckpt.lightning import DistModelCheckpoint

    monkeypatch.setenv(NO_EXCHANGE_ENV, "0" if exchange else "1")
    ldc.save(_state(7), str(tmp_path / "step=7.ckpt"))
    last = tmp_path / "last.ckpt"
    if there == "theirs":
        last.mkdir()
        (last / "notes.txt").write_text("a user's files")
    else:
        ldc.save(_state(3), str(last))
    trainer = Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
    if there == "theirs":
        with pytest.raises(CheckpointingError, match="not a checkpoint") as e:
            DistModelCheckpoint._link_checkpoint(trainer, str(tmp_path / "step=7.ckpt"), str(last))
        assert str(last) in str(e.value)
        assert (last / "notes.txt").read_text() == "a user's files"  # before: removed with its directory
        return
    DistModelCheckpoint._link_checkpoint(trainer, str(tmp_path / "step=7.ckpt"), str(last))
    assert os.readlink(last) == "step=7.ckpt" and ldc.load_common_state_dict(str(last))["step"] == 7
    assert sorted(os.listdir(tmp_path)) == ["last.ckpt", "step=7.ckpt"]  # the replaced checkpoint removed
