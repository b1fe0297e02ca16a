"""Node-local tiers, third red-team pass: what a job sharing its node root with a person or with another job
(one after the other, or with another temporary directory) could get wrong.

* **``clean`` of a root a running job holds** removed what that job was writing or about to put in place
  (an unfinished transfer, a torn step, a staging directory of a stopped process), judged by age alone.
  Now ``clean`` takes the root's lock first: a root a job holds keeps everything in it ("kept", naming
  the process), and a job does not start on a root while ``clean`` works there.
* **Jobs with different temporary directories** (systemd's ``PrivateTmp``, a container's ``/tmp``, SLURM's
  per-job ``TMPDIR``) did not see each other's lock, kept in ``$TMPDIR``: a second job took a root the
  first one held. Now the root also holds a lock file of its own.
* **A job after another on the same root** (the first paused or ended, its lock released): the later job's
  recovery counted the earlier job's steps as its own. A Trainer resumed another experiment's newer local
  step (its weights, with this run's model); a ``LocalTier`` or ``FabricTiers`` job resumed them on its
  first start. Now each local step records its run (``LocalTier(run=...)``; the Trainer's ``TierCheckpoint``
  keeps the run in its marker), and only the same run's steps are recovered; a restart of the same run
  still resumes from the local tier.
* **A rank store replaced by another save's** (a ShardedObject, or the whole store, copied in from another
  step): recovery fell back to the partner's copy and loaded exact values (sound), but the WARNING called the
  store damaged; it now says it was written by another save.
* Looked at and found sound (not repeated here): ``kill -9`` during replication then a restart with a node's
  directory deleted (tests/tiers/test_tiers_torn.py).

Real processes (the jobs), real files, real Trainer fits; each interleaving waits on marks, never on time.
"""

import json
import logging
import os
import shutil
import sys

import pytest

from dist_utils import run_distributed
from lightning_distckpt.cli.clean import clean
from lightning_distckpt.tiers import LocalTier, RecoveryPoint, TierOptions
from script_ranks import read_log, script_env, start_script, stop_all
from tiers.tier_helpers import check_loaded, options, state

pytestmark = pytest.mark.tiers

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# What every job script starts with: its own temporary directory (TMPDIR, read anew as a fresh interpreter
# would: the fork server may have cached its own), marks (files in the test's folder) and reports.
PREAMBLE = r'''
import json, os, sys, tempfile, time
sys.path.insert(0, TESTS)
tempfile.tempdir = None
marks = sys.argv[1]


def mark(name):
    open(os.path.join(marks, name), "w").close()


def wait_for(name):  # a hang guard only: the test marks it as soon as it is there
    deadline = time.monotonic() + 120
    while not os.path.exists(os.path.join(marks, name)):
        assert time.monotonic() < deadline, name
        time.sleep(0.005)


def report(name, result):  # whole once it has its name: the test reads it as soon as it is there
    with open(os.path.join(marks, name + ".tmp"), "w") as f:
        json.dump(result, f)
    os.replace(os.path.join(marks, name + ".tmp"), os.path.join(marks, name + ".json"))
'''.replace("TESTS", repr(TESTS))


class Job:
    """A script run as a process of its own (its environment plus ``env``), waited on through marks."""

    def __init__(self, tmp_path, name, text, args, env=None):
        self.marks = tmp_path / "marks"
        self.marks.mkdir(exist_ok=True)
        script = tmp_path / f"{name}.py"
        script.write_text(PREAMBLE + text)
        self.log = str(tmp_path / f"{name}.log")
        self.proc = start_script(str(script), [str(self.marks), *map(str, args)], {**script_env(), **(env or {})},
                                 self.log)

    def wait_for(self, name, timeout=120):
        """The mark ``name`` (a hang guard only: fails with the job's log when the job ends without it)."""
        path = self.marks / name
        while not path.exists():
            assert self.proc.is_alive() or path.exists(), f"no mark {name}:\n{read_log(self.log)[-4000:]}"
            self.proc.join(0.01)
            timeout -= 0.01
            assert timeout > 0, name
        return json.loads(path.read_text()) if name.endswith(".json") else None

    def mark(self, name):
        (self.marks / name).touch()

    def finish(self, timeout=120):
        self.proc.join(timeout)  # a failure bound, not a schedule
        stop_all([self.proc])
        assert self.proc.exitcode == 0, read_log(self.log)[-4000:]


# -- clean, and a second job, against a root a job holds -------------------------------------------------------
HOLDER = r'''
from lightning_distckpt.tiers import LocalTier, TierOptions
from tiers.tier_helpers import check_loaded, state
tier = LocalTier(TierOptions(local_dir=sys.argv[2], keep_local=2))
tier.save(state(0, 1, 10), 10)
tier.wait()
report("holder", {"pid": os.getpid(), "tmpdir": tempfile.gettempdir()})
wait_for("go_on")
# the job goes on: what it had in flight is still there, its step recovers exactly
transfer = os.path.join(sys.argv[2], ".ldc-tier-tmp-000000020-rank_00001")
out = tier.load(state(0, 1, 0, template=True), tier.recoverable())
check_loaded(out, 0, 1, 10)
report("holder_end", {"transfer_kept": os.path.isdir(transfer)})
tier.close()
'''

SECOND_JOB = r'''
from lightning_distckpt.tiers import LocalTier, TierOptions
try:
    tier = LocalTier(TierOptions(local_dir=sys.argv[2]))
    result = {"recovers": getattr(tier.recoverable(), "step", None)}
    tier.close()
except Exception as e:
    result = {"error": f"{type(e).__name__}: {e}"}
report("second", dict(result, tmpdir=tempfile.gettempdir()))
'''


def _fake_transfer(root):
    """What a transfer in flight (a partner's store being received) has in the root; unchanged a while."""
    path = os.path.join(root, ".ldc-tier-tmp-000000020-rank_00001")
    os.makedirs(os.path.join(path, "d"))
    with open(os.path.join(path, "d", "part"), "wb") as f:
        f.write(b"\0" * 4096)
    return path


def test_clean_keeps_what_is_in_a_root_a_running_job_holds(tmp_path):
    root = str(tmp_path / "local")
    job = Job(tmp_path, "holder", HOLDER, [root], env={"TMPDIR": str(tmp_path)})
    holder = job.wait_for("holder.json")
    transfer = _fake_transfer(root)
    try:
        # before: "removed" (idle >= --older-than 0): the job's transfer gone under it
        actions = clean(root, older_than_s=0, dry_run=False)
        assert [(a.leftover.path, a.action) for a in actions] == [(transfer, "kept")], actions
        assert "in use by a job" in actions[0].reason and f"pid {holder['pid']}" in actions[0].reason
        assert os.path.isdir(transfer)
        assert clean(root, older_than_s=0, dry_run=True)[0].action == "kept"
    finally:
        job.mark("go_on")
    assert job.wait_for("holder_end.json") == {"transfer_kept": True}
    job.finish()
    # the job has ended: the root is free, and what it left goes
    assert [a.action for a in clean(root, older_than_s=0, dry_run=False)] == ["removed"]
    assert not os.path.exists(transfer)
    assert sorted(os.listdir(root)) == ["step_000000010"]  # nothing of clean's left


def test_a_job_with_another_temporary_directory_cannot_take_a_held_root(tmp_path):
    """A private /tmp per job: the lock in $TMPDIR is invisible to the other job; the root's own is not."""
    root = str(tmp_path / "local")
    (tmp_path / "tmp_a").mkdir()
    (tmp_path / "tmp_b").mkdir()
    job = Job(tmp_path, "holder", HOLDER, [root], env={"TMPDIR": str(tmp_path / "tmp_a")})
    try:
        holder = job.wait_for("holder.json")
        second = Job(tmp_path, "second", SECOND_JOB, [root], env={"TMPDIR": str(tmp_path / "tmp_b")})
        out = second.wait_for("second.json")
        second.finish()
    finally:
        job.mark("go_on")
    job.finish()
    assert holder["tmpdir"] != out["tmpdir"]  # the jobs did not share a temporary directory
    # before: {"recovers": 10}: the second job took the root (and the first job's step as its own)
    assert "error" in out, out
    assert out["error"].startswith("ArgumentError") and "in use by another job" in out["error"]
    assert f"pid {holder['pid']}" in out["error"] and root in out["error"]


def test_a_job_does_not_start_on_a_root_clean_is_cleaning(tmp_path):
    """clean holds the root while it removes: a job starting then is refused, naming clean's process."""
    from lightning_distckpt.tiers.root_lock import hold_for_clean

    root = str(tmp_path / "local")
    tier = LocalTier(TierOptions(local_dir=root))  # a job that has ended
    tier.save(state(0, 1, 10), 10)
    tier.close()
    lock = os.path.join(root, ".ldc-tier-root.lock")
    assert not os.path.exists(lock)
    claim, holder = hold_for_clean(root, create=True)
    try:
        assert holder is None
        second = Job(tmp_path, "second", SECOND_JOB, [root])
        out = second.wait_for("second.json")
        second.finish()
        assert "in use by another job" in out.get("error", "") and f"pid {os.getpid()} (clean)" in out["error"], out
    finally:
        claim.release()
    assert not os.path.exists(lock)  # clean released it as a holder does


# -- a job after another on the same root ----------------------------------------------------------------------
def _saved(root, run, steps, value=0):
    tier = LocalTier(TierOptions(local_dir=root, keep_local=3), run=run)
    for step in steps:
        tier.save(state(0, 1, step + value, objects=False), step)
    tier.close()


def _recovers(root, run):
    """(step recovered, the step whose values it holds) for a job of ``run`` on ``root``; None: nothing."""
    tier = LocalTier(TierOptions(local_dir=root, keep_local=3), run=run)
    try:
        point = tier.recoverable()
        if point is None:
            return None
        out = tier.load(state(0, 1, 0, template=True, objects=False), point)
        return point.step, out["step"]
    finally:
        tier.close()


def test_a_later_job_never_resumes_the_earlier_jobs_steps(tmp_path):
    root = str(tmp_path / "local")
    _saved(root, "job-a", [10, 20], value=1000)  # job A, then paused (its lock released)
    assert _recovers(root, "job-b") is None  # before: job B's first start resumed A's step 20 (A's values)
    _saved(root, "job-b", [5])  # job B's first save prunes A's newer steps
    assert _recovers(root, "job-b") == (5, 5)  # B restarted: its own step, from the local tier
    assert _recovers(root, "job-a") is None  # A resumed: never B's step (falls back to its durable one)
    # saves without a run (earlier versions, or run=None) count for a tier without a run only
    _saved(root, None, [7])
    assert _recovers(root, None) == (7, 7) and _recovers(root, "job-b") == (5, 5)


def _save_two_nodes(rank, world, tmp, run):
    tier = LocalTier(options(tmp, ranks_per_node=1), run=run)
    tier.save(state(rank, world, 10), 10)
    tier.close()


def _recover_two_nodes(rank, world, tmp, run):
    tier = LocalTier(options(tmp, ranks_per_node=1), run=run)
    try:
        point = tier.recoverable()
        if point is None:
            return None
        out = tier.load(state(rank, world, 0, template=True), point)
        check_loaded(out, rank, world, tier.last_point.step)
        return tier.last_point
    finally:
        tier.close()


def test_the_run_travels_with_partner_copies_and_fetched_copies(tmp_path):
    """Every node's directory records the run (the other nodes' commits, a node's fetched copy): a node that
    lost its directory recovers the same run's step from its partner, never another run's."""
    tmp = str(tmp_path)
    run_distributed(_save_two_nodes, 2, tmp, "run-1")
    shutil.rmtree(os.path.join(tmp, "node1"))  # a lost node: its copy comes from node0 (a whole step fetched)
    assert run_distributed(_recover_two_nodes, 2, tmp, "run-1") == [RecoveryPoint(10, "local")] * 2
    for node in ("node0", "node1"):
        with open(os.path.join(tmp, node, "step_000000010", "COMMITTED")) as f:
            assert json.load(f)["tier_run"] == "run-1"
    assert run_distributed(_recover_two_nodes, 2, tmp, "run-2") == [None, None]


# A Trainer (1 process) under the tiers, in three fits of two experiments on one local_dir: A (to step 4),
# then B (another experiment, its own checkpoint folder, to step 6), then B again with ckpt_path="last" (the
# same run), then A again with ckpt_path="last". Each reports the step it started from and whether its weights then
# were those A (or B) had at that step.
TRAINER = r'''
import torch
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning_distckpt.lightning import DistCheckpointStrategy

work = sys.argv[2]
weights = {}


class Seen(Callback):
    def __init__(self, name):
        self.name = name

    def on_train_start(self, trainer, module):
        self.first = trainer.global_step
        self.start = [p.detach().clone() for p in module.parameters()]

    def on_train_batch_end(self, trainer, module, *args):
        weights[(self.name, trainer.global_step)] = [p.detach().clone() for p in module.parameters()]


def fit(name, steps, seed, ckpt_path=None):
    seed_everything(seed)
    tiers = {"local_dir": os.path.join(work, "local"), "local_every_n_steps": 2, "durable_every_n_steps": 4}
    seen = Seen(name)
    trainer = Trainer(accelerator="cpu", devices=1, strategy=DistCheckpointStrategy(checkpoint={"tiers": tiers}),
                      max_steps=steps, logger=False, enable_progress_bar=False, enable_model_summary=False,
                      enable_checkpointing=False, num_sanity_val_steps=0, callbacks=[seen],
                      default_root_dir=os.path.join(work, name))
    try:
        trainer.fit(BoringModel(), ckpt_path=ckpt_path)
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"}
    def same(step):
        return (name, step) in weights and all(torch.equal(a, b) for a, b in zip(seen.start, weights[(name, step)]))
    return {"first": seen.first, "same_as_own_step": same(seen.first)}


out = {"a": fit("a", 5, 1), "b": fit("b", 6, 2)}
out["b_again"] = fit("b", 7, 2, "last")
out["a_again"] = fit("a", 7, 1, "last")
report("trainer", out)
'''


def test_a_trainer_resumes_its_own_run_never_another_experiments_local_step(tmp_path):
    job = Job(tmp_path, "trainer", TRAINER, [tmp_path / "work"])
    out = job.wait_for("trainer.json", timeout=300)
    job.finish()
    assert out["a"]["first"] == 0 and out["b"]["first"] == 0, out  # first fits: from scratch
    # before: {"first": 6, "same_as_own_step": False}: A resumed B's newest local step (B's weights)
    assert out["a_again"] == {"first": 4, "same_as_own_step": True}, out  # its own durable step 4
    assert out["b_again"] == {"first": 6, "same_as_own_step": True}, out  # the same run: its local step 6
    # the markers record each experiment's run
    runs = [json.loads((tmp_path / "work" / n / "checkpoints" / "tiers-last.json").read_text()).get("run")
            for n in ("a", "b")]
    assert all(runs) and runs[0] != runs[1], runs


# -- a rank store replaced by another save's -------------------------------------------------------------------
def _save_steps(rank, world, tmp):
    tier = LocalTier(options(tmp, ranks_per_node=1))
    for step in (10, 20):
        tier.save(state(rank, world, step), step)
    tier.close()


class _Warnings(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _recover_logged(rank, world, tmp):
    handler = _Warnings()
    logging.getLogger("lightning_distckpt.tiers").addHandler(handler)
    tier = LocalTier(options(tmp, ranks_per_node=1))
    try:
        point = tier.recoverable()
        out = tier.load(state(rank, world, 0, template=True), point)
        check_loaded(out, rank, world, tier.last_point.step)
        return tier.last_point, handler.messages
    finally:
        tier.close()


def _replace_object(store_20, store_10):
    """Step 10's ShardedObject "rng" written into step 20's store (its OCDBT database), nothing else changed."""
    import tensorstore as ts

    def kv(path):
        return ts.KvStore.open({"driver": "ocdbt", "base": "file://" + path}).result()

    old, new = kv(store_10), kv(store_20)
    keys = [k for k in old.list().result() if k.startswith(b"o/rng/")]
    assert keys
    for k in keys:
        new.write(k, old.read(k).result().value).result()


@pytest.mark.parametrize("what", ["store", "object"])
def test_a_store_replaced_by_another_saves_is_named_so_and_its_partner_copy_used(tmp_path, what):
    tmp = str(tmp_path)
    run_distributed(_save_steps, 2, tmp)
    store = os.path.join(tmp, "node0", "step_{:09d}", "data", "rank_00000")
    if what == "store":  # step 10's store (its objects too) in step 20's place
        shutil.rmtree(store.format(20))
        shutil.copytree(store.format(10), store.format(20))
    else:
        _replace_object(store.format(20), store.format(10))
    (point0, messages), (point1, _) = run_distributed(_recover_logged, 2, tmp)
    assert point0 == point1 == RecoveryPoint(20, "local")  # node1's copy of rank 0's store, exact values
    named = [m for m in messages if "rank 0's store" in m and "is not used" in m]
    assert len(named) == 1, messages
    # before: "... is damaged and is not used: ... written by another save ..."
    if what == "store":  # its zarr.json names the other save: replaced, not damaged
        assert "was written by another save (replaced" in named[0] and "is damaged" not in named[0], named
    else:  # an object's checksum covers its save's token: which of the two cannot be told, and it says so
        assert "is damaged or was written by another save" in named[0], named


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))


def test_a_marker_another_job_wrote_after_setup_is_warned_about(tmp_path, caplog):
    """Setup found no marker (a new run), and another job saving to the same folder wrote one before this
    run's first local save: the marker is kept (this run's steps then are not what "last" resumes), and a
    WARNING says so, where before nothing did."""
    from lightning.pytorch import Callback, Trainer
    from lightning.pytorch.demos.boring_classes import BoringModel

    from lightning_distckpt.lightning import DistCheckpointStrategy

    folder = tmp_path / "run" / "checkpoints"

    class OtherJob(Callback):
        def on_train_start(self, trainer, module):
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "tiers-last.json").write_text(json.dumps({"what": "another job's", "run": "other"}))

    tiers = {"local_dir": str(tmp_path / "local"), "local_every_n_steps": 2, "durable_every_n_steps": 4}
    trainer = Trainer(accelerator="cpu", devices=1, strategy=DistCheckpointStrategy(checkpoint={"tiers": tiers}),
                      max_steps=3, logger=False, enable_progress_bar=False, enable_model_summary=False,
                      enable_checkpointing=False, num_sanity_val_steps=0, callbacks=[OtherJob()],
                      default_root_dir=str(tmp_path / "run"))
    import torch.distributed as dist

    had_group = dist.is_initialized()
    try:
        with caplog.at_level(logging.WARNING, logger="lightning_distckpt.lightning.tiers"):
            trainer.fit(BoringModel())
    finally:  # the strategy's one-process group: later tests in this process expect none
        if dist.is_initialized() and not had_group:
            dist.destroy_process_group()
    assert json.loads((folder / "tiers-last.json").read_text())["run"] == "other"  # not overwritten
    warned = [r.getMessage() for r in caplog.records if "names another run" in r.getMessage()]
    assert len(warned) == 1 and str(folder / "tiers-last.json") in warned[0], caplog.text
