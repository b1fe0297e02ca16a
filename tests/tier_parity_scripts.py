"""Shared parts of the tier-restore parity tests (tests/trust/test_trust_tier_restore_parity.py,
test_trust_tiers_round4_redteam.py, test_trust_tiers_round5_redteam.py): each restores one step from the
tiers and from durable storage, on 2 gloo processes as 2 simulated nodes (``ranks_per_node: 1``), and
compares.

Trainer side: the rank scripts (run by :func:`run_trainer_script` through ``script_ranks.run_ranks``) put
this folder on ``sys.path`` and import :class:`Recorder`, :class:`Seen`, :func:`fit_trainer`, ... from here.
Fabric side: the ``run_distributed`` workers use :func:`launch_fabric` and :func:`snapshot`.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from datetime import timedelta
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence

import torch
from lightning.pytorch import LightningModule
from torch import nn

#: Each group's timeout: a rank left waiting gets a CollectiveError (or a gloo error), told apart from the error a
#: test asserts. A hang guard, no schedule: nothing waits for it when every rank agrees.
GROUP_TIMEOUT_S = 30
TESTS = os.path.dirname(os.path.abspath(__file__))
#: The outcomes every rank shares (a scenario goes on after them): the rest stop the rank script.
AGREED = ("ok", "CheckpointingError", "MissingKeysError")


class Recorder:
    """``record(name, fn)``: ``fn``'s outcome under ``name`` in ``<out>.rank<rank>.json`` (rewritten after each);
    stops the script (no collective may follow) at an outcome every rank may not share: one not in ``agreed``."""

    def __init__(self, out: str, rank: int, agreed: Sequence[str] = AGREED) -> None:
        self.out, self.rank, self.agreed = out, rank, tuple(agreed)
        self.results: Dict[str, List[Any]] = {}

    def __call__(self, name: str, fn: Callable[[], Any]) -> None:
        from lightning_distckpt import CheckpointingError
        from lightning_distckpt.comm import CollectiveError

        try:
            self.results[name] = ["ok", fn()]
        except CollectiveError as e:
            self.results[name] = ["CollectiveError", str(e)[:600]]
        except CheckpointingError as e:
            self.results[name] = [type(e).__name__, str(e).split("\n--- traceback")[0][:3000]]
        except BaseException as e:  # noqa: BLE001 - told apart from an agreed error
            self.results[name] = ["unagreed " + type(e).__name__, str(e)[:600]]
        with open(f"{self.out}.rank{self.rank}.json", "w") as f:
            json.dump(self.results, f)
        if self.results[name][0] not in self.agreed:
            sys.exit(0)


class StepModule(LightningModule):
    """The rank scripts' modules: each step's batch drawn from the step's own seed (the same on any resume), data
    for 64 steps; ``fsdp``: FSDP2 over the data-parallel mesh (DistCheckpointModelParallelStrategy)."""

    fsdp = False

    def configure_model(self) -> None:
        if self.fsdp:
            from torch.distributed.fsdp import fully_shard

            fully_shard(self, mesh=self.device_mesh["data_parallel"])

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x = torch.randn(2, 3, generator=torch.Generator().manual_seed(self.global_step))  # the step's, on any resume
        return self(x).pow(2).mean()

    def train_dataloader(self) -> Any:
        return torch.utils.data.DataLoader(list(range(64)), batch_size=1)


def _seen_class() -> type:
    from lightning.pytorch import Callback

    from lightning_distckpt.lightning.tiers import tier_callback

    class Seen(Callback):
        """The step a fit starts training at, and the point its tier read (None: no tier, or none read)."""

        step = point = None

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            self.step = trainer.global_step
            cb = tier_callback(trainer)
            point = cb.local_tier.last_point if cb is not None and cb.local_tier is not None else None
            self.point = None if point is None else [point.step, point.source]

    return Seen


def full(t: torch.Tensor) -> torch.Tensor:
    """A parameter or state tensor whole (a DTensor gathered)."""
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def snapshot(model: nn.Module, opt: Any) -> Dict[str, list]:
    """Every parameter and its optimizer state, whole, as lists: by name (``a.weight``, ``a.weight.exp_avg``)."""
    params = dict(model.named_parameters())
    out = {n: full(p).tolist() for n, p in params.items()}
    out.update({f"{n}.{k}": full(v).tolist() for n, p in params.items() for k, v in opt.state.get(p, {}).items()})
    return out


def tier_config(root: str, durable: Optional[int] = None, config: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """``config`` with a ``tiers:`` section: a local save every step under ``<root>/local/<node>``, one rank a node;
    ``durable``: ``durable_every_n_steps`` (None: the Trainer's own ModelCheckpoints save, as without tiers)."""
    out = dict(config or {})
    out["tiers"] = {"local_dir": os.path.join(root, "local", "{node}"), "local_every_n_steps": 1,
                    "ranks_per_node": 1, **({"durable_every_n_steps": durable} if durable is not None else {})}
    return out


def dist_strategy(scenario: str, config: Optional[Dict[str, Any]] = None) -> Any:
    """``"mp"``: DistCheckpointModelParallelStrategy (FSDP2 over both ranks); else DistCheckpointStrategy."""
    from lightning_distckpt.lightning import DistCheckpointModelParallelStrategy, DistCheckpointStrategy

    timeout = timedelta(seconds=GROUP_TIMEOUT_S)
    if scenario == "mp":
        return DistCheckpointModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1, timeout=timeout,
                                                   checkpoint=config or {})
    return DistCheckpointStrategy(timeout=timeout, checkpoint=config or {}, find_unused_parameters=True)


def fit_trainer(model: Any, root: str, steps: int, strategy: Any, ckpt_path: Optional[str] = None,
                callbacks: Iterable[Any] = (), **trainer_kw: Any) -> Dict[str, Any]:
    """A real fit of ``model`` on both ranks to ``steps``; the step it started at, the tier's point then, and the
    parameters and optimizer state it ends with (:func:`snapshot`)."""
    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint

    seen = _seen_class()()
    callbacks = [seen, *callbacks]
    kw = {"enable_checkpointing": any(isinstance(c, ModelCheckpoint) for c in callbacks), **trainer_kw}
    trainer = Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=steps, callbacks=callbacks,
                      logger=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                      default_root_dir=root, use_distributed_sampler=False, **kw)
    trainer.fit(model, ckpt_path=ckpt_path)
    return {"first": seen.step, "point": seen.point, "state": snapshot(model, trainer.optimizers[0])}


def summary(got: Dict[str, Any], want: Dict[str, Any]) -> Dict[str, Any]:
    """The point resumed, the first step, and which entries differ from ``want`` (parameters and optimizer state)."""
    return {"point": got["point"], "first": got["first"],
            "differ": sorted(k for k in set(got["state"]) | set(want["state"])
                             if k not in got["state"] or k not in want["state"] or got["state"][k] != want["state"][k])}


def overwrite_every_local_copy(root: str) -> None:
    """The biggest file of every store of every local step under ``<root>/local``, every byte changed: whatever part
    of a restore reads a store finds it damaged (the listing, which checks sizes and the commit markers, does not)."""
    stores: Dict[str, List[str]] = {}
    for d, _, files in os.walk(os.path.join(root, "local")):
        parts = d.split(os.sep)
        if "data" in parts[:-1] and parts[parts.index("data") + 1].startswith("rank_"):
            store = os.sep.join(parts[:parts.index("data") + 2])
            stores.setdefault(store, []).extend(os.path.join(d, f) for f in files)
    for files in stores.values():
        path = max(files, key=os.path.getsize)
        with open(path, "rb") as f:
            raw = f.read()
        with open(path, "wb") as f:
            f.write(bytes(b ^ 0xA5 for b in raw))


def last(root: str) -> str:
    """The durable ``last.ckpt`` of a fit in ``root`` (the TierCheckpoint's folder)."""
    return os.path.join(root, "checkpoints", "last.ckpt")


def script_preamble() -> str:
    """The first lines of a rank script: this folder importable, Python's warnings off, the rank."""
    return (f"import os\nimport sys\nimport warnings\n\nsys.path.insert(0, {TESTS!r})\n"
            "warnings.simplefilter('ignore')\n"
            # Lightning's subprocess launcher (LDC_TEST_SCRIPT_LAUNCH=subprocess) sets LOCAL_RANK in the ranks it
            # starts only: the script it was started from, without one, is rank 0
            "rank = int(os.environ.get('LOCAL_RANK', '0'))\n")


def run_trainer_script(tmp_path: Any, script: str, argv: Sequence[str],
                       agreed: Optional[Sequence[str]] = None) -> List[Dict[str, Any]]:
    """Run the rank ``script`` (its text) on 2 ranks with ``<tmp>/ck <tmp>/out *argv``; every rank's results
    (:class:`Recorder`). ``agreed``: the outcomes each result must be one of (None: not checked)."""
    from script_ranks import run_ranks, script_env

    path = tmp_path / "ranks.py"
    path.write_text(script_preamble() + script)
    (tmp_path / "ck").mkdir()
    code, output = run_ranks(str(path), [str(tmp_path / "ck"), str(tmp_path / "out"), *argv], script_env(), 2,
                             timeout=300)
    results = []
    for rank in range(2):
        out = tmp_path / f"out.rank{rank}.json"
        assert out.is_file(), f"rank {rank} wrote no results (exit {code}):\n{output[-6000:]}"
        results.append(json.loads(out.read_text()))
    assert code == 0, output[-6000:]
    for res in results if agreed is not None else ():
        for name, (kind, _) in res.items():
            assert kind in agreed, (name, res[name])
    return results


def launch_fabric(rank: int, world: int, strategy: Any) -> Any:
    """Fabric in this process of the group, as torchrun would have started it (the group exists)."""
    from lightning.fabric import Fabric

    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT="1", NODE_RANK="0", LOCAL_WORLD_SIZE=str(world))
    warnings.simplefilter("ignore")
    fabric = Fabric(accelerator="cpu", devices=world, strategy=strategy)
    fabric.launch()
    return fabric
