"""Failures in the middle of a save, sync and async, at the Lightning layer: what a red-team probe found.

* An async save that failed in the background (rank 1's writes hit a file-size limit, a full-disk
  stand-in) under ``DistCheckpointStrategy`` was raised at the first step boundary where each rank's
  own background thread had ended. The threads end at slightly different moments, so one rank raised
  ``SaveFailedError`` and left ``fit`` while the others went on into the next step's collectives, where
  they failed with gloo's "Connection closed by peer" once it exited, or hung until the collective
  timeout while it did not. Now a failed background save is raised where every rank is at the same
  point (the next save, the end of training, teardown), and the older checkpoint ``ModelCheckpoint``
  wanted to remove survives.
* An async save (its name held by an empty directory while in flight, ``reserve_targets``) killed in
  its commit after the commit marker was durable: the committed checkpoint stayed in its staging
  directory beside the empty placeholder, which no recovery replaced (only a *missing* target was
  recovered), so ``ckpt_path="last"`` (``save_last="link"``) failed on "an empty directory" and the
  newest committed checkpoint was lost to the run; ``clean`` said to move the placeholder away. Now
  the committed copy is renamed over the empty placeholder as over nothing, by the next load (and
  ``clean``). Killed before its marker, the placeholder is still refused, never taken for a checkpoint.
"""

import json
import os

import pytest
from script_ranks import read_log, run_ranks, script_env, start_script

from lightning_distckpt.storage.commit import KILL_AT_ENV
from lightning_distckpt.storage.staging import is_staging_dir

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Two ranks under DistCheckpointStrategy with async saves and ModelCheckpoint(save_top_k=1) every 2
# steps. Step 2's save commits; step 4's fails on rank 1 (RLIMIT_FSIZE, SIGXFSZ ignored: EFBIG).
# Rank 0's background thread is held after the save's agreement (in release_target) until rank 0 is
# inside step 5's training_step, so that at the boundary before it rank 1's thread has ended (it
# joins it there) and rank 0's has not: the order in which the threads end that made the ranks part.
# Each rank records every exception its Trainer saw, with the step, then resumes from step 2.
STEP_BOUNDARY = r'''
import json, os, resource, signal, sys, time
from datetime import timedelta
sys.path.insert(0, TESTS)
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
import lightning_distckpt as ldc
from lightning_distckpt.lightning import DistCheckpointStrategy
from lightning_distckpt.saving import async_pending
from lightning_helpers import TPMLP

folder, out = sys.argv[1], sys.argv[2]
rank = int(os.environ["LOCAL_RANK"])
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
res = {"seen": []}


def mark(name):
    open(os.path.join(folder, name), "w").close()


def wait_for(*groups):  # each group: files that must all exist; any group will do
    deadline = time.monotonic() + 60  # a hang guard only: the ranks' 30 s collective timeout comes first
    while not any(all(os.path.exists(os.path.join(folder, n)) for n in g) for g in groups):
        assert time.monotonic() < deadline, groups
        time.sleep(0.005)


if rank == 0:
    real_release = async_pending.release_target

    def held_release(target, *store):
        if target.endswith("step=4.ckpt"):
            wait_for(["rank0_in_step5", "rank1_past"], ["rank0_in_step5", "rank1_raised"])
        real_release(target, *store)

    async_pending.release_target = held_release


class Model(TPMLP):
    def training_step(self, batch, batch_idx):
        if rank == 0 and self.trainer.global_step == 4:
            mark("rank0_in_step5")
        return super().training_step(batch, batch_idx)


class Steps(Callback):
    def on_train_batch_end(self, trainer, *args):
        if rank == 1 and trainer.global_step == 3:
            trainer.strategy.checkpoint_io.wait()  # step 2's save committed
            resource.setrlimit(resource.RLIMIT_FSIZE, (64, hard))

    def on_train_batch_start(self, trainer, *args):  # before the strategy's own hook at this boundary
        if rank == 1 and trainer.global_step == 4:
            trainer.strategy.checkpoint_io.pending.wait()  # this rank's thread has ended (the save failed)
        if rank == 1 and trainer.global_step == 5:
            mark("rank1_past")

    def on_exception(self, trainer, module, exc):
        res["seen"].append([type(exc).__name__, trainer.global_step, str(exc)[:400]])
        if rank == 1:
            mark("rank1_raised")


def trainer(steps, *callbacks):
    return Trainer(accelerator="cpu", devices=2, max_steps=steps, logger=False, enable_progress_bar=False,
                   enable_model_summary=False, num_sanity_val_steps=0,
                   strategy=DistCheckpointStrategy(timeout=timedelta(seconds=30), checkpoint={"async_save": True}),
                   callbacks=[*callbacks, ModelCheckpoint(os.path.join(folder, "ck"), filename="{step}",
                                                          every_n_train_steps=2, save_top_k=1)])


try:
    trainer(8, Steps()).fit(Model(total_steps=8))
    res["fit"] = "finished"
except BaseException as e:
    res["fit"] = f"{type(e).__name__}: {str(e)[:400]}"
resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
mark(f"rank{rank}_fit_ended")  # the folder is listed once both ranks handled the failure (rank 0 removes
wait_for(["rank0_fit_ended", "rank1_fit_ended"])  # the failed save's placeholder as it raises)
res["files"] = sorted(os.listdir(os.path.join(folder, "ck")))
if res["seen"] and {s[0] for s in res["seen"]} == {"SaveFailedError"}:  # else the ranks parted: no collective now
    resumed = trainer(3)
    try:
        resumed.fit(TPMLP(total_steps=3), ckpt_path=os.path.join(folder, "ck", "step=2.ckpt"))
        res["resumed"] = resumed.global_step
    except BaseException as e:
        res["resumed"] = f"{type(e).__name__}: {str(e)[:400]}"
with open(f"{out}.rank{rank}.json", "w") as f:
    json.dump(res, f)
'''.replace("TESTS", repr(TESTS))


def test_a_background_failure_is_raised_at_the_same_step_on_every_rank(tmp_path):
    script = tmp_path / "ranks.py"
    script.write_text(STEP_BOUNDARY)
    code, output = run_ranks(str(script), [str(tmp_path), str(tmp_path / "out")], script_env(), 2, timeout=180)
    results = []
    for rank in range(2):
        path = tmp_path / f"out.rank{rank}.json"
        assert path.is_file(), f"rank {rank} wrote no results (exit {code}):\n{output[-6000:]}"
        results.append(json.loads(path.read_text()))
    for rank, res in enumerate(results):
        # one exception per rank, the save's, at step 6 (the next save), on every rank alike
        assert [s[:2] for s in res["seen"]] == [["SaveFailedError", 6]], (rank, res["seen"])
        assert "step=4.ckpt" in res["seen"][0][2] and "rank 1" in res["seen"][0][2], res["seen"]
        assert "File too large" in res["seen"][0][2]
        # ModelCheckpoint's removal of step 2 was dropped: it survives, step 4 never appeared
        assert res["files"] == ["step=2.ckpt"], res["files"]
        assert res["resumed"] == 3  # and the ranks, still together, resume from it


# One process: a Trainer saving every 2 steps in the background (DistCheckpointIO async, as plain
# ModelCheckpoint users do), save_last="link"; step 2's save commits, step 4's is killed at KILL_STEP
# in its commit (the background thread SIGKILLs the process there).
KILLED_FIT = r"""
import os, sys
sys.path.insert(0, TESTS)
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning_distckpt.lightning import DistCheckpointIO
from lightning_distckpt.storage.commit import KILL_AT_ENV

folder, kill_step = sys.argv[1], sys.argv[2]

class KillStep4(Callback):
    def on_train_batch_end(self, trainer, *args):  # runs before ModelCheckpoint's save of this step
        if trainer.global_step == 4:
            trainer.strategy.checkpoint_io.wait()  # step 2's save committed
            os.environ[KILL_AT_ENV] = kill_step

Trainer(accelerator="cpu", devices=1, max_steps=6, logger=False, enable_progress_bar=False,
        enable_model_summary=False, plugins=[DistCheckpointIO({"async_save": True})],
        callbacks=[KillStep4(), ModelCheckpoint(folder, filename="{step}", every_n_train_steps=2, save_top_k=-1,
                                                save_last="link")]).fit(BoringModel())
""".replace("TESTS", repr(TESTS))


@pytest.mark.parametrize("kill_step,resumed_step", [("after_marker", 4), ("after_metadata", None)])
def test_an_async_save_killed_in_its_commit_then_ckpt_path_last(tmp_path, isolated_process_group, kill_step,
                                                                 resumed_step):
    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.demos.boring_classes import BoringModel

    import lightning_distckpt as ldc
    from lightning_distckpt.cli.clean import clean
    from lightning_distckpt.lightning import DistCheckpointIO

    folder = tmp_path / "ck"
    script = tmp_path / "fit.py"
    script.write_text(KILLED_FIT)
    env = {**script_env(), KILL_AT_ENV: ""}
    proc = start_script(str(script), [str(folder), kill_step], env, str(tmp_path / "fit.log"))
    proc.join(120)
    assert proc.exitcode == -9, read_log(str(tmp_path / "fit.log"))[-4000:]  # SIGKILLed in step 4's commit
    assert os.readlink(folder / "last.ckpt") == "step=4.ckpt" and os.listdir(folder / "step=4.ckpt") == []

    class Resumed(BoringModel):
        def on_train_start(self):
            self.started_at = self.trainer.global_step

    module = Resumed()
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=7, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, plugins=[DistCheckpointIO()],
                      callbacks=[ModelCheckpoint(folder, filename="{step}", every_n_train_steps=2, save_top_k=-1,
                                                 save_last="link")])
    if resumed_step is None:  # never committed: the placeholder is refused, not taken for a checkpoint
        with pytest.raises(ldc.IncompleteCheckpointError, match="an empty directory"):
            trainer.fit(module, ckpt_path="last")
        assert os.listdir(folder / "step=4.ckpt") == []
    else:  # committed before the kill: the next load renames it over the placeholder
        trainer.fit(module, ckpt_path="last")
        assert module.started_at == resumed_step
        assert DistCheckpointIO().load_checkpoint(folder / "step=4.ckpt")["global_step"] == 4
    assert DistCheckpointIO().load_checkpoint(folder / "step=2.ckpt")["global_step"] == 2  # the older one survives
    for action in clean(str(folder), 0, False):  # what is left is a never-committed leftover
        assert action.action == "removed", (action.leftover.path, action.reason)
    assert not [n for n in os.listdir(folder) if is_staging_dir(n)]
