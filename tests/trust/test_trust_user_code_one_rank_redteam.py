"""User code that raises, or returns something wrong, on one rank only during a collective save or load:
every rank raises the same error, none is left waiting, nothing half-written is left, nothing is lost.

What a red-team probe found (each on the old code: the failing rank raised alone, or went on with wrong
state, and its peers waited in their next collective until the group's timeout, or got gloo's "Connection
closed by peer" once it exited):

* A ShardedObject whose value cannot be pickled on one rank (a lambda, a lock; core ``save``, sync and
  async, and one that ``on_save_checkpoint`` adds under ``DistCheckpointStrategy``): it was pickled only
  after the save's last collective of its preparation, so that rank raised an ``AttributeError`` /
  ``TypeError`` alone; the others wrote their part and waited for it in the commit's agreement, and a
  staging directory was left. Now each main replica is pickled while the rank describes its state
  (``saving/object_bytes.py``): every rank raises the same CheckpointingError naming the key and the element
  before anything is written. One that pickles past what a load reads (``PICKLE_CAP``) was saved without a
  word and refused at the resume: now a WARNING at the save, as for the common state.
* A ``ShardedTensorFactory`` whose ``build_fn`` returns something other than sharded entries (the plain
  tensor itself, a string, a number): on load it was silently not read (the template's value kept, no
  error, on that rank alone); on save silently not written (on one rank a ValidationError about coverage
  that named no factory). Now a ShardingError naming the factory and what it returned, on every rank
  (``core/state_dict.apply_factories``).
* Under ``DistCheckpointStrategy``, a ``merge_fn`` giving one rank a value the module does not take (another
  shape): Lightning's ``load_model_state_dict`` raised there alone, the others went on into setup's
  collectives. Now the strategy's ``load_model_state_dict`` agrees its outcome: every rank raises it.
* The optimizer path: a ``merge_fn`` giving one rank a wrong optimizer state. torch's ``load_state_dict``
  took it unchecked; that rank's first ``step()`` failed inside training while the other waited in DDP's
  all-reduce. Now ``restore_optimizer_state`` refuses a state tensor that does not come back a tensor of its
  shape, and the restore after setup (and a local tier's) agrees its outcome.
* Fabric: a stateful object of the state whose ``load_state_dict`` raises on one rank (a DataLoader's, a
  data module's) raised there alone; the other waited in ``fabric.load``'s barrier. Now the loaded state is
  put in place on every rank and the outcome agreed (``lightning/fabric.apply_loaded``, local tiers too).

Found sound, kept as regressions: ``build_fn`` raising on one rank (save and load), a ``key_map`` raising
on one rank, a LocalNonpersistentObject that cannot be pickled (it is never saved), and (in the probe)
``sharded_state_dict()`` raising or returning a non-dict on one rank, ``merge_fn`` raising on one rank, a
common value (``on_save_checkpoint``, a callback's ``state_dict()``) that cannot be pickled on one rank.

Not ours, left as they are: a hook that raises inside Lightning before or after our collectives
(``on_save_checkpoint`` of a module or callback, a callback's or data module's ``state_dict()``, all in
``Trainer.save_checkpoint``'s ``dump_checkpoint`` before the strategy's save; ``on_load_checkpoint``, a
callback's or data module's ``load_state_dict`` after the strategy's load) raises on that rank alone, and
the others meet a CollectiveError in their next collective (at once when that rank's process exits, at the
group's timeout while it lives). Ranks passing different groups (a subgroup on one, the world on another)
wait in different collectives: each gets a CollectiveError at the group's timeout, nothing is written.

Hang guards: each group times out after ``GROUP_TIMEOUT_S``; a rank left waiting gets a CollectiveError,
told apart from the error asserted, and a scenario stops at the first outcome not agreed.
"""

import json
import logging
import os
import threading

import pytest
import torch
import torch.distributed as dist

import lightning_distckpt as ldc
from dist_utils import run_distributed
from script_ranks import run_ranks, script_env
from trust.test_trust_load_one_rank_fails_redteam import _first_lines, _in_step, _outcome

GROUP_TIMEOUT_S = 30
TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _objects(rank, world, bad):
    """A ShardedObject per rank (rank 1's holding ``bad``), a nonpersistent one, a tensor."""
    return {"o": ldc.ShardedObject("o", bad if rank == 1 else {"rank": rank}, (world,), (rank,)),
            "local": ldc.LocalNonpersistentObject(threading.Lock()),  # never saved: no pickling
            "w": ldc.ShardedTensor.from_rank_offsets("w", torch.full((2, 3), float(rank)), (0, rank, world))}


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _unpicklable_objects(rank, world, root):
    out = {}
    for bad in ("lambda", "lock"):
        for mode in ("sync", "async"):
            if not _in_step(out):
                break
            value = (lambda: 1) if bad == "lambda" else threading.Lock()

            def save():
                request = ldc.save(_objects(rank, world, value), os.path.join(root, f"{bad}_{mode}"),
                                   async_save=mode == "async")
                if request is not None:
                    request.finalize()
                return "saved"
            out[bad, mode] = _first_lines(_outcome(save))
    if not _in_step(out):
        return out, None, None, None
    # in step: a save of a large object, then a load of it, works; the object is said to be past the cap
    records = _Records()
    logging.getLogger("lightning_distckpt").addHandler(records)
    os.environ["LIGHTNING_DISTCKPT_MAX_COMMON_BYTES"] = "100000"
    ldc.save(_objects(rank, world, b"x" * 200_000), os.path.join(root, "again"))
    del os.environ["LIGHTNING_DISTCKPT_MAX_COMMON_BYTES"]
    loaded = ldc.load({"o": ldc.ShardedObject("o", None, (world,), (rank,))}, os.path.join(root, "again"))["o"]
    return out, len(loaded) if rank == 1 else loaded, records.lines, sorted(os.listdir(root))


def test_an_object_that_cannot_be_pickled_on_one_rank_fails_every_rank_before_writing(tmp_path):
    results = run_distributed(_unpicklable_objects, 2, str(tmp_path), timeout_s=GROUP_TIMEOUT_S)
    (out0, *_), (out1, *_) = results
    assert list(out0) == list(out1) == [("lambda", "sync"), ("lambda", "async"), ("lock", "sync"),
                                         ("lock", "async")], results
    for case, (kind, message) in out0.items():
        assert out1[case] == (kind, message), (case, results)
        assert kind == "CheckpointingError" and "failed before writing: rank 1:" in message, (case, message)
        assert "ShardedObject 'o' element (1,) cannot be serialized" in message, (case, message)
        assert ("Can't pickle" if case[0] == "lambda" else "cannot pickle '_thread.lock'") in message, message
        assert "rank 0:" not in message, message
    for rank, (_, loaded, warned, listed) in enumerate(results):
        assert listed == ["again"], listed  # nothing of the refused saves: no staging directory either
        assert loaded == (200_000 if rank == 1 else {"rank": 0}), loaded
        said = [w for w in warned if "ShardedObject 'o' element (1,) pickles to" in w]
        assert len(said) == (1 if rank == 1 else 0), warned  # by the rank that writes it
        assert not said or "LIGHTNING_DISTCKPT_MAX_COMMON_BYTES" in said[0], said


def _factory(key, data, rank, world, bad):
    """Rows of ``key`` over the ranks; rank 1's ``build_fn`` does ``bad``."""
    def build(k, t, replica_id, flattened_range):
        if rank == 1 and bad == "raise":
            raise ValueError("build_fn failed on rank 1")
        if rank == 1 and bad is not None:
            return {"tensor": t, "str": "oops", "list": [ldc.ShardedTensor.from_rank_offsets(k, t, (0, rank, world)),
                                                         3]}[bad]
        return ldc.ShardedTensor.from_rank_offsets(k, t, (0, rank, world))

    return ldc.ShardedTensorFactory(key, data, build, lambda loaded: loaded)


def _wrong_builds(rank, world, root):
    good = os.path.join(root, "good")
    ldc.save({"f": _factory("f", torch.full((2, 3), rank + 1.0), rank, world, None)}, good)
    out = {}
    for bad in ("tensor", "str", "list", "raise"):
        for op in ("load", "save"):
            if not _in_step(out):
                break
            entry = _factory("f", torch.zeros(2, 3) if op == "load" else torch.ones(2, 3), rank, world, bad)
            if op == "load":
                out[bad, op] = _first_lines(_outcome(lambda: ldc.load({"f": entry}, good)["f"].tolist()))
            else:
                out[bad, op] = _first_lines(_outcome(lambda: ldc.save({"f": entry}, os.path.join(root, "bad"))))
    return out, sorted(os.listdir(root))


def test_a_build_fn_returning_no_sharded_entries_on_one_rank_is_refused_on_every_rank(tmp_path):
    results = run_distributed(_wrong_builds, 2, str(tmp_path), timeout_s=GROUP_TIMEOUT_S)
    (out0, listed0), (out1, listed1) = results
    assert list(out0) == list(out1) and len(out0) == 8, results
    assert listed0 == listed1 == ["good"], results  # no refused save left anything
    said = {"tensor": "returned Tensor as its expansion", "str": "returned str as its expansion",
            "list": "returned int at [1]"}
    for (bad, op), (kind, message) in out0.items():
        assert out1[bad, op] == (kind, message), (bad, op, results)
        if bad == "raise":  # found sound
            assert kind == "CheckpointingError" and "rank 1: ValueError: build_fn failed on rank 1" in message
            continue
        assert kind == "ShardingError", (bad, op, kind, message)
        assert f"rank 1: 'f': ShardedTensorFactory.build_fn {said[bad]}" in message, (bad, op, message)
        assert "rank 0:" not in message, message


def test_a_build_fn_returning_the_tensor_is_refused_not_dropped(tmp_path):
    """One process: the key was left out of a committed checkpoint, and the load kept the template's values."""
    def build(k, t, replica_id, flattened_range):
        return t  # the tensor instead of ShardedTensor.from_rank_offsets(k, t)

    with pytest.raises(ldc.ShardingError, match="'f': ShardedTensorFactory.build_fn returned Tensor"):
        ldc.save({"f": ldc.ShardedTensorFactory("f", torch.ones(3), build, lambda x: x)}, tmp_path / "ck")
    assert not os.path.exists(tmp_path / "ck")
    ldc.save({"f": ldc.ShardedTensor.from_rank_offsets("f", torch.ones(3))}, tmp_path / "ok")
    with pytest.raises(ldc.ShardingError, match="'f': ShardedTensorFactory.build_fn returned Tensor"):
        ldc.load({"f": ldc.ShardedTensorFactory("f", torch.zeros(3), build, lambda x: x)}, tmp_path / "ok")


def _key_map_fails(rank, world, root):
    """Found sound: a key_map raising on one rank fails the load on every rank (it runs where the source is
    opened, inside the load's first agreement)."""
    from safetensors.torch import save_file

    path = os.path.join(root, "m.safetensors")
    if rank == 0:
        save_file({"model.w": torch.arange(8.0)}, path)
    dist.barrier()

    def key_map(key):
        if rank == 1:
            raise ValueError("key_map failed on rank 1")
        return key.removeprefix("model.")
    template = {"w": ldc.ShardedTensor.from_rank_offsets("w", torch.zeros(4), (0, rank, world))}
    return _first_lines(_outcome(lambda: ldc.load(template, path, key_map=key_map)))


def test_a_key_map_raising_on_one_rank_fails_every_rank(tmp_path):
    results = run_distributed(_key_map_fails, 2, str(tmp_path), timeout_s=GROUP_TIMEOUT_S)
    for kind, message in results:  # (the failing rank, which opened nothing, says "the checkpoint" for its path)
        assert kind == "CheckpointingError" and "failed: rank 1: ValueError: key_map failed on rank 1" in message


# Two ranks: SCENARIO under DistCheckpointStrategy (TP 1, DP 2; Trainers one after another in the same
# processes), or under FabricDistCheckpointStrategy. fc2.weight is saved and loaded through a factory whose
# merge_fn misbehaves on rank 1 where the scenario asks for it. Each rank records each step's outcome and
# stops at the first one that is not ok or an agreed CheckpointingError (the ranks would be out of step);
# after the scenario, a clean resume (a load) shows the ranks still in step.
RANKS = r"""
import json, os, sys
from datetime import timedelta
sys.path.insert(0, TESTS)
import torch
import lightning_distckpt as ldc
from lightning_distckpt.core.errors import CheckpointingError, CollectiveError

folder, out, SCENARIO = sys.argv[1:4]
rank = int(os.environ["LOCAL_RANK"])
res = {}


def record(name, fn):
    try:
        res[name] = ["ok", fn()]
    except CollectiveError as e:
        res[name] = ["CollectiveError", str(e)[:600]]
    except CheckpointingError as e:
        res[name] = [type(e).__name__, str(e).split("\n--- traceback")[0][:600]]
    except BaseException as e:
        res[name] = ["unagreed " + type(e).__name__, str(e)[:600]]
    with open(f"{out}.rank{rank}.json", "w") as f:
        json.dump(res, f)
    if res[name][0] not in ("ok", "CheckpointingError"):
        sys.exit(0)  # out of step: no collective may follow


if SCENARIO in ("fabric_stateful", "fabric_mp_stateful"):  # DDP, and ModelParallel (FSDP2 over the 2 ranks)
    from lightning.fabric import Fabric
    from torch.distributed.fsdp import fully_shard
    from lightning_distckpt.lightning import FabricDistCheckpointModelParallelStrategy, FabricDistCheckpointStrategy

    class Stateful:  # a data loader's or data module's state, say
        def state_dict(self):
            return {"rank": rank}

        def load_state_dict(self, state):
            if rank == 1:
                raise ValueError("load_state_dict failed on rank 1")

    def parallelize(model, mesh):
        fully_shard(model, mesh=mesh["data_parallel"])
        return model

    timeout = timedelta(seconds=GROUP_TIMEOUT_S)
    fabric = Fabric(accelerator="cpu", devices=2, strategy=FabricDistCheckpointStrategy(timeout=timeout)
                    if SCENARIO == "fabric_stateful" else
                    FabricDistCheckpointModelParallelStrategy(parallelize, data_parallel_size=2, tensor_parallel_size=1,
                                                              timeout=timeout))
    fabric.launch()
    model = fabric.setup_module(torch.nn.Linear(4, 2))
    path = os.path.join(folder, "fabric")
    fabric.save(path, {"model": model, "s": Stateful()})
    record(SCENARIO, lambda: fabric.load(path, {"model": model, "s": Stateful()}))
    record("again", lambda: sorted(fabric.load(path, {"model": model})))
    sys.exit(0)

from lightning.pytorch import Trainer
from lightning_distckpt.lightning import DistCheckpointStrategy
from lightning_helpers import TPMLP

MODE = None


class Model(TPMLP):
    phase = "model"  # the module's factories merge in load_checkpoint; the optimizer's after on_load_checkpoint

    def sharded_state_dict(self, prefix=""):
        sd = super().sharded_state_dict(prefix)
        key = f"{prefix}fc2.weight"

        def build(k, t, replica_id, flattened_range):
            return ldc.ShardedTensor.from_rank_offsets(k, t.detach(), replica_id=replica_id)

        def merge(loaded):
            if rank == 1 and (MODE, self.phase) == ("module_shape", "model"):
                return torch.zeros(3, 3)
            if rank == 1 and (MODE, self.phase) == ("optimizer_junk", "optimizer"):
                return "junk"
            return loaded
        sd[key] = ldc.ShardedTensorFactory(key, self.fc2.weight, build, merge, replica_id=self.ps.replicated_id)
        return sd

    def on_load_checkpoint(self, checkpoint):
        self.phase = "optimizer"

    def on_save_checkpoint(self, checkpoint):
        if MODE == "object_lambda":  # every rank adds its element; rank 1's cannot be pickled
            checkpoint["extra"] = ldc.ShardedObject("extra", (lambda: 1) if rank == 1 else 1, (2,), (rank,))


def trainer(steps):
    return Trainer(accelerator="cpu", devices=2, max_steps=steps, logger=False, enable_progress_bar=False,
                   enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0,
                   strategy=DistCheckpointStrategy(timeout=timedelta(seconds=GROUP_TIMEOUT_S)))


good = os.path.join(folder, "good")
first = trainer(1)
first.fit(Model(total_steps=2))
first.save_checkpoint(good)


def resume():
    t = trainer(2)
    t.fit(Model(total_steps=2), ckpt_path=good)
    return t.global_step


MODE = SCENARIO
if SCENARIO == "object_lambda":
    record(SCENARIO, lambda: first.save_checkpoint(os.path.join(folder, "bad")))
else:
    record(SCENARIO, resume)
MODE = None
record("again", resume)
res["listed"] = sorted(os.listdir(folder))
with open(f"{out}.rank{rank}.json", "w") as f:
    json.dump(res, f)
""".replace("TESTS", repr(TESTS)).replace("GROUP_TIMEOUT_S", str(GROUP_TIMEOUT_S))

LIGHTNING_CASES = {
    "object_lambda": ["bad failed before writing: rank 1: checkpoint",
                      "ShardedObject 'extra' element (1,) cannot be serialized: AttributeError"],
    "module_shape": ["restore of the module's weights failed after reading: rank 1: RuntimeError",
                     "size mismatch for fc2.weight"],
    "optimizer_junk": ["good failed after reading: rank 1: optimizer AdamW: state 'exp_avg' of parameter "
                       "'fc2.weight' was loaded as str, not a tensor of shape (4, 16)"],
    "fabric_stateful": ["restore of the loaded state failed after reading: rank 1: ValueError: load_state_dict "
                        "failed on rank 1"],
    "fabric_mp_stateful": ["restore of the loaded state failed after reading: rank 1: ValueError: load_state_dict "
                           "failed on rank 1"],
}


@pytest.mark.parametrize("scenario", sorted(LIGHTNING_CASES))
def test_lightning_saves_and_restores_failing_on_one_rank_fail_every_rank(tmp_path, scenario):
    script = tmp_path / "ranks.py"
    script.write_text(RANKS)
    folder = tmp_path / "ck"
    folder.mkdir()
    code, output = run_ranks(str(script), [str(folder), str(tmp_path / "out"), scenario], script_env(), 2,
                             timeout=240)
    results = []
    for rank in range(2):
        path = tmp_path / f"out.rank{rank}.json"
        assert path.is_file(), f"rank {rank} wrote no results (exit {code}):\n{output[-6000:]}"
        results.append(json.loads(path.read_text()))
    assert results[0] == results[1], results  # every outcome, word for word, and what the folder holds
    res = results[0]
    kind, message = res[scenario]
    assert kind == "CheckpointingError", res
    for said in LIGHTNING_CASES[scenario]:
        assert said in message, (said, message)
    assert "rank 0:" not in message, message
    # still in step: a clean resume (fabric: a load) works, and a refused save left nothing
    assert res["again"] == (["ok", ["s"]] if scenario.startswith("fabric") else ["ok", 2]), res
    assert res.get("listed", ["good"]) == ["good"], res
