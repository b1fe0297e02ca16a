"""The commit against ``clean`` and against kills, with real saves in other processes.

* ``clean --older-than 0`` run at every step of a running commit (the committing process stops
  itself there with SIGSTOP, ``LIGHTNING_DISTCKPT_TEST_STOP_AT``, and is resumed once clean and a
  load have run): the save always succeeds and its checkpoint loads, with and without
  renameat2(RENAME_EXCHANGE), replacing a checkpoint or not, and with two ranks' owner notes.
* ``--older-than`` nan / inf / -1 / -inf refused (CLI and Python API); a folder of checkpoints
  that also holds a ``data/`` folder is looked into, not taken for one checkpoint.
* The two-rename commit (RENAME_EXCHANGE forced off) SIGKILLed at each of its steps
  (``LIGHTNING_DISTCKPT_TEST_KILL_AT``): the next load, save, clean and Lightning
  ``ckpt_path="last"`` find the previous checkpoint while the target still holds it, and the new one
  once the target was moved aside (its marker was durable before): exact values, nothing lost.
"""

import json
import logging
import math
import os
import shutil
import signal
import subprocess
import sys
from typing import Dict, List, Optional

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer

import lightning_distckpt as ldc
from dist_utils import free_port
from lightning_distckpt.cli import main
from lightning_distckpt.cli.clean import clean
from lightning_distckpt.core.errors import ArgumentError, ArgumentTypeError
from lightning_distckpt.lightning import DistCheckpointIO, DistModelCheckpoint
from lightning_distckpt.storage.commit import COMMIT_STEPS, KILL_AT_ENV, NO_EXCHANGE_ENV, STOP_AT_ENV
from lightning_distckpt.storage.staging import OWNERS_DIR, find_leftovers, is_staging_dir

N = 4096
TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# One rank of a real save of ``w`` = VALUE everywhere and ``step`` = int(VALUE) to TARGET; a
# world of WORLD ranks joins a gloo group first.
SAVER = """
import os, sys, datetime, torch, torch.distributed as dist, lightning_distckpt as ldc
target, value, rank, world, port = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
if world > 1:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
part = %d // world
w = ldc.ShardedTensor.from_rank_offsets("w", torch.full((part,), value), (0, rank, world))
ldc.save({"w": w, "step": int(value)}, target)
print("saved", flush=True)
if world > 1:  # a gloo group left to interpreter exit can abort it (pytorch#179291): leave together, destroy it
    dist.barrier()
    dist.destroy_process_group()
""" % N


def start_save(target, value: float, env: Dict[str, str], rank: int = 0, world: int = 1,
               port: int = 0) -> subprocess.Popen:
    full = {**os.environ, "OMP_NUM_THREADS": "1", **env}
    return subprocess.Popen([sys.executable, "-c", SAVER, str(target), str(value), str(rank), str(world), str(port)],
                            env=full, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def wait_exit(proc: subprocess.Popen, on_stop=None) -> int:
    """Reap ``proc``, calling ``on_stop()`` each time it stops itself (then resuming it); its exit
    status (-signal when killed)."""
    while True:
        _, status = os.waitpid(proc.pid, os.WUNTRACED)
        if os.WIFSTOPPED(status):
            if on_stop is not None:
                on_stop()
            os.kill(proc.pid, signal.SIGCONT)
            continue
        proc.returncode = os.waitstatus_to_exitcode(status)
        return proc.returncode


def save_in_process(target, value: float, env: Dict[str, str]) -> int:
    proc = start_save(target, value, env)
    code = wait_exit(proc)
    out, err = proc.communicate(timeout=60)
    assert code in (0, -signal.SIGKILL), err[-3000:]
    return code


def load_value(target) -> Optional[float]:
    """The checkpoint's ``w`` (checked constant) and ``step``, or None when there is none."""
    template = {"w": ldc.ShardedTensor.from_rank_offsets("w", torch.zeros(N))}
    try:
        w = ldc.load(template, target)["w"]
    except ldc.IncompleteCheckpointError:
        return None
    assert torch.equal(w, torch.full((N,), w[0].item()))
    assert ldc.load_common_state_dict(target)["step"] == int(w[0].item())
    return w[0].item()


def staging_names(parent) -> List[str]:
    return sorted(n for n in os.listdir(parent) if is_staging_dir(n))


# -- clean at every step of a running commit -------------------------------------------------------
# CI runs two of the four (each commit path once, each kind of target once); all four with `-m long`
@pytest.mark.parametrize("exchange,replace", [
    pytest.param(False, True, id="two-renames-replace"), pytest.param(True, False, id="exchange-first-save"),
    pytest.param(True, True, id="exchange-replace", marks=pytest.mark.long),
    pytest.param(False, False, id="two-renames-first-save", marks=pytest.mark.long)])
def test_clean_at_every_commit_step_never_breaks_the_save(tmp_path, exchange, replace):
    target = tmp_path / "ck"
    if replace:
        ldc.save({"w": ldc.ShardedTensor.from_rank_offsets("w", torch.full((N,), 1.0)), "step": 1}, target)
    env = {STOP_AT_ENV: ",".join(COMMIT_STEPS), NO_EXCHANGE_ENV: "0" if exchange else "1"}
    proc = start_save(target, 2.0, env)
    seen: List[Optional[float]] = []

    def at_step() -> None:
        staging = [os.path.join(tmp_path, n) for n in staging_names(tmp_path) if not n.endswith((".old", ".old1"))]
        for _ in range(3):  # the loop the bug report ran: every pass must leave the running save alone
            assert main(["clean", str(tmp_path), "--older-than", "0"]) == 0
        clean(str(target), 0.0, False)  # given the checkpoint itself
        for path in staging:  # the running save's staging dir: still there, or renamed into place
            assert os.path.isdir(path) or load_value(target) == 2.0, path
        seen.append(load_value(target))

    assert wait_exit(proc, at_step) == 0, proc.communicate(timeout=60)[1][-3000:]
    assert proc.communicate(timeout=60)[0].strip() == "saved"
    assert load_value(target) == 2.0
    assert staging_names(tmp_path) == [] and OWNERS_DIR not in os.listdir(target)
    # each load found the old checkpoint (or none, on a first save) until the new one, never after it
    first_new = seen.index(2.0) if 2.0 in seen else len(seen)
    assert set(seen[:first_new]) <= ({1.0} if replace else {None}) and set(seen[first_new:]) <= {2.0}, seen
    assert len(seen) >= 4


def test_every_ranks_note_stays_until_the_marker_is_durable(tmp_path):
    """Two ranks (gloo): rank 1 waits for the commit while rank 0 stops at each step. Until the
    marker is written both notes are there and both writers are seen as live; clean keeps it all."""
    target = tmp_path / "ck"
    ldc.save({"w": ldc.ShardedTensor.from_rank_offsets("w", torch.full((N,), 1.0)), "step": 1}, target)
    port = free_port()
    env = {STOP_AT_ENV: ",".join(COMMIT_STEPS), NO_EXCHANGE_ENV: "1"}
    rank0 = start_save(target, 2.0, env, 0, 2, port)
    rank1 = start_save(target, 2.0, {}, 1, 2, port)
    states = []

    def at_step() -> None:
        staging = [lo for lo in find_leftovers(str(tmp_path), "ck") if not lo.path.endswith(".old")]
        notes = sorted(os.listdir(os.path.join(staging[0].path, OWNERS_DIR))) if staging and os.path.isdir(
            os.path.join(staging[0].path, OWNERS_DIR)) else []
        states.append((staging[0].committed if staging else None, notes,
                       staging[0].live_owner_pids if staging else ()))
        assert main(["clean", str(tmp_path), "--older-than", "0"]) == 0
        assert load_value(target) in (1.0, 2.0)

    assert wait_exit(rank0, at_step) == 0, rank0.communicate(timeout=60)[1][-3000:]
    assert rank1.wait(timeout=120) == 0, rank1.communicate(timeout=60)[1][-3000:]
    assert load_value(target) == 2.0 and staging_names(tmp_path) == []
    both = ["rank_00000.json", "rank_00001.json"]
    assert states[0] == (False, both, tuple(sorted((rank0.pid, rank1.pid))))  # after_metadata
    assert states[1] == (True, both, tuple(sorted((rank0.pid, rank1.pid))))  # after_marker
    assert states[2][:2] == (True, [])  # after_notes_removed: the marker keeps it
    for rank in (rank0, rank1):
        rank.communicate(timeout=60)


# -- --older-than must be a finite number >= 0 -------------------------------------------------------
def _remote_running_save(tmp_path) -> str:
    """A staging directory 5 s old whose writer runs on another node (its note names another host)."""
    staging = tmp_path / ".ck.distckpt-staging-0123456789ab"
    (staging / OWNERS_DIR).mkdir(parents=True)
    (staging / OWNERS_DIR / "rank_00000.json").write_text(json.dumps(
        {"host": "another-node", "pid": 1, "rank": 0, "started_unix": 0}))
    (staging / "common.pt").write_bytes(b"x" * 100)
    for p in (staging / OWNERS_DIR / "rank_00000.json", staging / OWNERS_DIR, staging / "common.pt", staging):
        os.utime(p, (os.path.getmtime(p) - 5,) * 2)
    return str(staging)


@pytest.mark.parametrize("value", ["nan", "inf", "-1", "-inf", "-0.5", "1e400", "x"])
def test_older_than_that_is_not_a_finite_age_is_refused(tmp_path, value, capsys):
    staging = _remote_running_save(tmp_path)
    for argv in (["--older-than", value], [f"--older-than={value}"]):
        with pytest.raises(SystemExit) as exit_:
            main(["clean", str(tmp_path), *argv])
        assert exit_.value.code == 2  # argparse's exit status for a bad argument, as for any usage error
        assert "--older-than" in capsys.readouterr().err
    assert os.path.isdir(staging)


def test_older_than_is_checked_by_the_python_api_and_the_command(tmp_path):
    staging = _remote_running_save(tmp_path)
    for value in (math.nan, math.inf, -1, -math.inf, -1e-9):
        with pytest.raises(ArgumentError, match="finite number of seconds >= 0"):
            clean(str(tmp_path), value, False)
    for value in ("600", None, True, [1]):
        with pytest.raises(ArgumentTypeError, match="older_than_s must be a number"):
            clean(str(tmp_path), value, False)
    out = subprocess.run([sys.executable, "-m", "lightning_distckpt", "clean", str(tmp_path), "--older-than=-inf"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--older-than" in out.stderr
    assert os.path.isdir(staging)
    assert [a.action for a in clean(str(tmp_path), 600, False)] == ["kept"]  # recent: another node's save
    assert [a.action for a in clean(str(tmp_path), 0, False)] == ["removed"]  # 0 is the caller's word


# -- a folder of checkpoints with a data/ folder ----------------------------------------------------
def test_a_folder_of_checkpoints_with_a_data_folder_is_looked_into(tmp_path, capsys):
    ckpts = tmp_path / "run"
    (ckpts / "data").mkdir(parents=True)
    (ckpts / "data" / "train.txt").write_text("the user's data")
    (ckpts / "metadata.json").write_text('{"dataset": "not ours"}')
    ldc.save({"w": ldc.ShardedTensor.from_rank_offsets("w", torch.full((N,), 1.0)), "step": 1}, ckpts / "step=1.ckpt")
    assert save_in_process(ckpts / "step=2.ckpt", 2.0, {KILL_AT_ENV: "after_metadata"}) == -signal.SIGKILL
    (leftover,) = [os.path.join(ckpts, n) for n in staging_names(ckpts)]
    hour_ago = os.path.getmtime(leftover) - 3600
    for dirpath, dirs, files in os.walk(leftover):
        for name in files + dirs:
            os.utime(os.path.join(dirpath, name), (hour_ago, hour_ago))
    os.utime(leftover, (hour_ago, hour_ago))
    assert main(["clean", str(ckpts), "--dry-run", "--json"]) == 0
    (action,) = json.loads(capsys.readouterr().out)
    assert action["path"] == leftover and action["action"] == "would remove"
    assert main(["clean", str(ckpts)]) == 0
    assert "removed" in capsys.readouterr().out and not os.path.exists(leftover)
    assert (ckpts / "data" / "train.txt").read_text() == "the user's data"
    assert load_value(ckpts / "step=1.ckpt") == 1.0
    # one checkpoint, by our own markers: its leftovers are beside it (and the run folder is not one)
    assert save_in_process(ckpts / "step=1.ckpt", 3.0, {KILL_AT_ENV: "after_metadata"}) == -signal.SIGKILL
    assert [os.path.basename(a.leftover.target) for a in clean(str(ckpts / "step=1.ckpt"), 0, False)] == ["step=1.ckpt"]
    assert clean(str(tmp_path), 0, False) == []  # tmp_path holds no leftovers of its own


# -- the two-rename commit killed at each step ------------------------------------------------------
TWO_RENAME_STEPS = ("after_metadata", "after_marker", "after_notes_removed", "after_first_rename",
                    "after_rename_in", "after_cleanup")
MOVED_ASIDE = ("after_first_rename", "after_rename_in", "after_cleanup")  # the target had been moved aside


@pytest.fixture(scope="module")
def killed_states(tmp_path_factory):
    """``make(step, replace)``: a directory holding that killed state, made once per module."""
    made: Dict[tuple, str] = {}

    def make(step: str, replace: bool) -> str:
        if (step, replace) not in made:
            root = tmp_path_factory.mktemp(f"killed_{step}_{replace}")
            if replace:
                ldc.save({"w": ldc.ShardedTensor.from_rank_offsets("w", torch.full((N,), 1.0)), "step": 1},
                         root / "ck")
            assert save_in_process(root / "ck", 2.0, {KILL_AT_ENV: step, NO_EXCHANGE_ENV: "1"}) == -signal.SIGKILL
            made[(step, replace)] = str(root)
        return made[(step, replace)]

    return make


def _killed_commit(tmp_path, killed_states, step: str, replace: bool):
    """A copy of: ck holding value 1 (when ``replace``), then a save of value 2 killed at ``step``
    (the copy keeps names, contents and mtimes). Returns the target and the value the next
    operation must find there (None: no checkpoint)."""
    shutil.copytree(killed_states(step, replace), tmp_path, symlinks=True, dirs_exist_ok=True)
    marker_durable = step != "after_metadata"
    new = step in MOVED_ASIDE or (not replace and marker_durable)
    return tmp_path / "ck", 2.0 if new else (1.0 if replace else None)


KILLS = [(s, True) for s in TWO_RENAME_STEPS] + [(s, False) for s in ("after_metadata", "after_marker",
                                                                       "after_notes_removed")]


@pytest.mark.parametrize("step,replace", KILLS)
def test_killed_commit_then_load(tmp_path, killed_states, step, replace, caplog):
    target, expected = _killed_commit(tmp_path, killed_states, step, replace)
    with caplog.at_level(logging.WARNING, logger="lightning_distckpt"):
        assert load_value(target) == expected
    recovered = [r.getMessage() for r in caplog.records if "renamed the committed copy" in r.getMessage()]
    assert len(recovered) == (1 if step == "after_first_rename" or (not replace and expected == 2.0) else 0)
    assert load_value(target) == expected  # and again, now without anything to recover
    if step == "after_first_rename":  # the previous checkpoint moved aside went with the recovery
        assert not [n for n in staging_names(tmp_path) if ".old" in n]


@pytest.mark.parametrize("step,replace", KILLS)
def test_killed_commit_then_save(tmp_path, killed_states, step, replace, caplog):
    target, expected = _killed_commit(tmp_path, killed_states, step, replace)
    with caplog.at_level(logging.WARNING, logger="lightning_distckpt"):
        ldc.save({"w": ldc.ShardedTensor.from_rank_offsets("w", torch.full((N,), 3.0)), "step": 3}, target)
    assert load_value(target) == 3.0
    if target.exists() and step == "after_first_rename":
        assert any("renamed the committed copy" in r.getMessage() for r in caplog.records)
    # whatever is left is a leftover clean may remove (nothing newer than the target, nothing running)
    for action in clean(str(tmp_path), 0, False):
        assert action.action == "removed", (action.leftover.path, action.reason)
    assert staging_names(tmp_path) == [] and load_value(target) == 3.0


@pytest.mark.parametrize("step,replace", KILLS)
def test_killed_commit_then_clean(tmp_path, killed_states, step, replace, capsys):
    target, expected = _killed_commit(tmp_path, killed_states, step, replace)
    assert main(["clean", str(tmp_path), "--older-than", "0", "--json"]) == 0
    actions = {a["action"] for a in json.loads(capsys.readouterr().out)}
    assert load_value(target) == expected
    if step == "after_first_rename" or (not replace and expected == 2.0):
        assert "recovered" in actions
    newer_kept = replace and step in ("after_marker", "after_notes_removed")  # committed, never swapped in
    assert len(staging_names(tmp_path)) == (1 if newer_kept else 0), staging_names(tmp_path)
    assert actions <= {"recovered", "removed", "kept"}


LOADER = """
import logging, sys, torch, lightning_distckpt as ldc
logging.basicConfig(level=logging.WARNING)  # the library logs through a NullHandler: show its WARNINGs
print("ready", flush=True)
sys.stdin.readline()  # all start together
w = ldc.load({"w": ldc.ShardedTensor.from_rank_offsets("w", torch.zeros(%d))}, sys.argv[1])["w"]
print(w[0].item() if torch.equal(w, torch.full_like(w, w[0].item())) else "mixed", flush=True)
""" % N


def test_ranks_loading_at_once_all_finish_the_interrupted_commit(tmp_path, killed_states):
    """Four processes load the checkpoint a commit left missing (killed between its two renames),
    released together: each renames or finds the committed copy in place; one recovers it."""
    target, expected = _killed_commit(tmp_path, killed_states, "after_first_rename", True)
    procs = [subprocess.Popen([sys.executable, "-c", LOADER, str(target)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
             for _ in range(4)]
    for proc in procs:
        assert proc.stdout.readline().strip() == "ready", proc.communicate(timeout=60)[1][-3000:]
    for proc in procs:
        proc.stdin.write("go\n")
        proc.stdin.flush()
    results = [proc.communicate(timeout=120) for proc in procs]
    assert [p.returncode for p in procs] == [0] * 4, [err[-2000:] for _, err in results]
    assert [float(out.strip()) for out, _ in results] == [expected] * 4
    assert sum("renamed the committed copy" in err for _, err in results) == 1
    assert staging_names(tmp_path) == [] and load_value(target) == expected


# -- Lightning: ckpt_path="last" after a commit of last.ckpt killed at each step --------------------
class Tiny(LightningModule):
    """A seeded linear layer with SGD; records the step and weights it starts from."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(4, 2)
        self.restored_step: Optional[int] = None
        self.restored: Dict[str, torch.Tensor] = {}

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.lin(x), y)

    def on_train_start(self) -> None:
        self.restored_step = self.trainer.global_step
        self.restored = {k: v.clone() for k, v in self.state_dict().items()}

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(1)
        data = torch.utils.data.TensorDataset(torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g))
        return torch.utils.data.DataLoader(data, batch_size=2)


class KeepWeights(Callback):
    """Keeps each step's weights beside the checkpoints (to compare with exactly), and arms the kill
    for the save of step 2. Runs before ModelCheckpoint's hook (Lightning orders checkpoints last)."""

    def __init__(self, dirpath: str, kill_at: str) -> None:
        self.dirpath, self.kill_at = dirpath, kill_at

    def on_train_batch_end(self, trainer, module, *args) -> None:
        torch.save({k: v.clone() for k, v in module.state_dict().items()},
                   os.path.join(self.dirpath, f"weights{trainer.global_step}.pt"))
        if trainer.global_step == 2:
            os.environ[KILL_AT_ENV] = self.kill_at


def _trainer(max_steps: int, callbacks) -> Trainer:
    return Trainer(accelerator="cpu", devices=1, max_steps=max_steps, callbacks=callbacks, plugins=[DistCheckpointIO()],
                   logger=False, enable_progress_bar=False, enable_model_summary=False)


def _last_callback(dirpath) -> DistModelCheckpoint:
    return DistModelCheckpoint(dirpath=str(dirpath), save_top_k=0, save_last=True, every_n_train_steps=1)


def _lightning_child(dirpath: str, kill_at: str) -> None:
    """Fit 2 steps saving last.ckpt after each (DistCheckpointIO, two renames); the save of step 2
    is killed at ``kill_at``."""
    os.environ[NO_EXCHANGE_ENV] = "1"
    _trainer(2, [KeepWeights(dirpath, kill_at), _last_callback(os.path.join(dirpath, "ck"))]).fit(Tiny())


# CI runs the step that leaves last.ckpt missing; the other steps run with `-m long`
@pytest.mark.parametrize("step", [s if s == "after_first_rename" else pytest.param(s, marks=pytest.mark.long)
                                  for s in TWO_RENAME_STEPS])
def test_killed_commit_of_last_then_ckpt_path_last(tmp_path, step, isolated_process_group):
    code = f"import sys; sys.path.insert(0, {TESTS!r}); import trust.test_trust_commit as t; " \
           f"t._lightning_child({str(tmp_path)!r}, {step!r})"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == -signal.SIGKILL, out.stderr[-3000:]
    expected = 2 if step in MOVED_ASIDE else 1
    module = Tiny()
    _trainer(3, [_last_callback(tmp_path / "ck")]).fit(module, ckpt_path="last")
    assert module.restored_step == expected
    weights = torch.load(tmp_path / f"weights{expected}.pt")
    assert module.restored.keys() == weights.keys()
    assert all(torch.equal(module.restored[k], weights[k]) for k in weights)
    assert DistCheckpointIO().load_checkpoint(tmp_path / "ck" / "last.ckpt")["global_step"] == 3  # saved on
    for action in clean(str(tmp_path / "ck"), 0, False):  # what is left is superseded or never committed
        assert action.action == "removed", (action.leftover.path, action.reason)
