"""What Lightning's own ModelParallelStrategy tests check (``tests_pytorch/strategies/test_model_parallel.py``,
``tests_fabric/strategies/test_model_parallel*.py`` at 2.6.5), checked on our subclasses on CPU.

Lightning's tests mock torch.distributed and DCP; these run the real thing: 2 gloo processes, an FSDP2
(``fully_shard``) module over the data-parallel mesh, ``FabricDistCheckpointModelParallelStrategy`` under a
real ``Fabric`` and ``DistCheckpointModelParallelStrategy`` under a real ``Trainer``. What they check, here as
our contract (where ours differs from stock on purpose the test says so; the peer run's triage is in
``tools/peer_suites/lightning/RESULTS.md``):

* the path is rank 0's (the strategies broadcast it), files are written once, no DCP files;
* ``storage_options``: stock refuses any; ours takes ``StorageOptions`` fields and refuses anything else
  with a ``TypeError`` naming it, before writing;
* ``filter`` keeps only the entries it accepts;
* a save to an existing directory or file that is not our checkpoint: stock writes into / replaces it;
  ours refuses, naming the path, and leaves it as it was;
* ``fabric.load_raw(file, module)``: a full state-dict file loads into the sharded module (strict: a missing key
  is named); an optimizer alone and a directory are refused, with stock's errors;
* a load of a directory holding no checkpoint fails on every rank naming the path; a path that does not
  exist is a ``FileNotFoundError``; ``state=None`` returns the whole checkpoint (stock refuses it).
"""

from __future__ import annotations

import os
import traceback
from datetime import timedelta
from typing import Any, Callable, Dict, List

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dist_utils import free_port, run_distributed

GROUP_TIMEOUT_S = 30  # a hang guard only: every wait below is on a collective


def _fsdp(model: nn.Module, mesh: Any) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    return fully_shard(model, mesh=mesh["data_parallel"])


def _outcome(fn: Callable[[], Any]) -> Dict[str, Any]:
    """``fn()``'s value, or the exception's types (its MRO's names) and message."""
    try:
        return {"ok": fn()}
    except Exception as e:  # the test asserts on what was raised
        return {"types": [c.__name__ for c in type(e).__mro__], "message": str(e),
                "trace": traceback.format_exc()[-2000:]}


def _full(module: nn.Module) -> Dict[str, torch.Tensor]:
    """The module's weights, whole (collective for DTensors)."""
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in module.state_dict().items()}


def _prepare(rank: int, base: str) -> Dict[str, str]:
    """Paths of this run; rank 0 puts a foreign directory, a foreign file and a raw state-dict file in place."""
    paths = {name: os.path.join(base, name) for name in ("foreign", "file.pt", "empty", "raw.pt", "partial.pt")}
    if rank == 0:
        os.makedirs(paths["foreign"])
        with open(os.path.join(paths["foreign"], "notes.txt"), "w") as f:
            f.write("not a checkpoint")
        with open(paths["file.pt"], "w") as f:
            f.write("not a checkpoint")
        os.makedirs(paths["empty"])
        torch.manual_seed(7)
        raw = nn.Linear(4, 4).state_dict()
        torch.save(raw, paths["raw.pt"])
        torch.save({"weight": raw["weight"]}, paths["partial.pt"])
    return paths


def _fabric_checks(rank: int, base: str) -> Dict[str, Any]:
    from lightning.fabric import Fabric

    from lightning_distckpt.lightning import FabricDistCheckpointModelParallelStrategy

    strategy = FabricDistCheckpointModelParallelStrategy(_fsdp, data_parallel_size=2, tensor_parallel_size=1,
                                                         timeout=timedelta(seconds=GROUP_TIMEOUT_S))
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    paths = _prepare(rank, base)
    fabric.barrier()
    torch.manual_seed(0)
    model = fabric.setup_module(nn.Linear(4, 4))
    opt = fabric.setup_optimizers(torch.optim.Adam(model.parameters()))
    out: Dict[str, Any] = {}
    out["per_rank_path"] = _outcome(lambda: fabric.save(os.path.join(base, f"fab_rank{rank}"), {"model": model}))
    out["bad_options"] = _outcome(lambda: strategy.save_checkpoint(os.path.join(base, "fab_bad_options"),
                                                                   {"model": model}, storage_options=object()))
    zarr = {"layout": "zarr"}
    out["zarr_options"] = _outcome(lambda: strategy.save_checkpoint(os.path.join(base, "fab_zarr"), {"model": model},
                                                                    storage_options=zarr))
    out["filtered"] = _outcome(lambda: fabric.save(os.path.join(base, "fab_filtered"), {"model": model, "step": 3},
                                                   filter={"model": lambda k, v: k == "weight"}))
    out["whole"] = _outcome(lambda: {k: sorted(v) if isinstance(v, dict) else v
                                     for k, v in fabric.load(os.path.join(base, "fab_filtered")).items()})
    out["foreign_dir"] = _outcome(lambda: fabric.save(paths["foreign"], {"model": model}))
    out["foreign_file"] = _outcome(lambda: fabric.save(paths["file.pt"], {"model": model}))
    out["load_empty"] = _outcome(lambda: fabric.load(paths["empty"], {"model": model}))
    out["load_missing"] = _outcome(lambda: fabric.load(os.path.join(base, "nowhere"), {"model": model}))
    out["raw"] = _outcome(lambda: fabric.load_raw(paths["raw.pt"], model))
    out["raw_full"] = _full(model)
    out["raw_partial"] = _outcome(lambda: fabric.load_raw(paths["partial.pt"], model))
    out["raw_optimizer"] = _outcome(lambda: fabric.load_raw(paths["raw.pt"], opt))
    out["raw_directory"] = _outcome(lambda: fabric.load_raw(os.path.join(base, "fab_zarr"), model))
    return out


def _trainer_checks(rank: int, base: str) -> Dict[str, Any]:
    from lightning.pytorch import LightningModule, Trainer

    from lightning_distckpt.lightning import DistCheckpointModelParallelStrategy

    class Module(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Linear(4, 4)

        def configure_model(self) -> None:
            _fsdp(self.net, self.device_mesh)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self.net(batch[0]).square().mean()

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            self.net(batch[0])

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.parameters(), lr=0.1)

        def train_dataloader(self) -> DataLoader:
            return DataLoader(TensorDataset(torch.ones(4, 4)), batch_size=2)

        val_dataloader = train_dataloader

    def trainer() -> Trainer:
        strategy = DistCheckpointModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1,
                                                       timeout=timedelta(seconds=GROUP_TIMEOUT_S))
        return Trainer(accelerator="cpu", devices=2, max_steps=1, logger=False, enable_checkpointing=False,
                       enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
                       limit_val_batches=1, num_sanity_val_steps=0, strategy=strategy)

    first = trainer()
    first.fit(Module())
    out: Dict[str, Any] = {}
    out["per_rank_path"] = _outcome(lambda: first.save_checkpoint(os.path.join(base, f"tr_rank{rank}")))
    out["bad_options"] = _outcome(lambda: first.save_checkpoint(os.path.join(base, "tr_bad_options"),
                                                                storage_options=object()))
    out["zarr_options"] = _outcome(lambda: first.save_checkpoint(os.path.join(base, "tr_zarr"),
                                                                 storage_options={"layout": "zarr"}))
    out["foreign_dir"] = _outcome(lambda: first.save_checkpoint(os.path.join(base, "foreign")))
    out["load_empty"] = _outcome(lambda: trainer().validate(Module(), ckpt_path=os.path.join(base, "empty"),
                                                            verbose=False))
    return out


def _checks(rank: int, world: int, base: str, port: int) -> Dict[str, Any]:
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))  # Fabric and the Trainer join the group run_distributed made
    fabric = _fabric_checks(rank, base)
    trainer = _trainer_checks(rank, base)
    return {"fabric": fabric, "trainer": trainer, "listing": sorted(os.listdir(base)),
            "foreign": sorted(os.listdir(os.path.join(base, "foreign"))),
            "file": open(os.path.join(base, "file.pt")).read()}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> List[Dict[str, Any]]:
    base = tmp_path_factory.mktemp("mp_peer")
    out = run_distributed(_checks, 2, str(base), free_port(), timeout_s=120)
    for r in out:
        r["base"] = str(base)
    return out


def _ok(outcome: Dict[str, Any]) -> Any:
    assert "ok" in outcome, outcome.get("trace")
    return outcome["ok"]


@pytest.mark.parametrize("side, prefix", [("fabric", "fab"), ("trainer", "tr")])
def test_the_path_is_rank_zeros_and_no_dcp_files(ranks, side, prefix):
    """A save where each rank names its own path writes rank 0's path only (the strategy broadcasts it, as
    stock does); the checkpoint is ours (``metadata.json``), with none of DCP's ``.metadata`` / ``meta.pt``."""
    for r in ranks:
        _ok(r[side]["per_rank_path"])
    assert f"{prefix}_rank0" in ranks[0]["listing"] and f"{prefix}_rank1" not in ranks[0]["listing"]
    files = os.listdir(os.path.join(ranks[0]["base"], f"{prefix}_rank0"))
    assert "metadata.json" in files and ".metadata" not in files and "meta.pt" not in files


@pytest.mark.parametrize("side, prefix", [("fabric", "fab"), ("trainer", "tr")])
def test_storage_options_are_ours_and_bad_ones_refused_before_writing(ranks, side, prefix):
    """Stock refuses any ``storage_options``; ours takes ``StorageOptions`` fields (``layout: zarr`` writes zarr
    arrays) and refuses another object with a ``TypeError`` naming its type, on every rank, writing nothing."""
    for r in ranks:
        bad = r[side]["bad_options"]
        assert "TypeError" in bad["types"] and "got object" in bad["message"], bad
        _ok(r[side]["zarr_options"])
    assert f"{prefix}_bad_options" not in ranks[0]["listing"]
    tree = [f for _, _, files in os.walk(os.path.join(ranks[0]["base"], f"{prefix}_zarr")) for f in files]
    assert "zarr.json" in tree


def test_fabric_filter_keeps_only_what_it_accepts(ranks):
    """``fabric.save(..., filter={"model": ...})`` saves the accepted keys only; other entries are untouched;
    ``fabric.load(path)`` (no state: stock refuses it) returns the whole checkpoint."""
    for r in ranks:
        _ok(r["fabric"]["filtered"])
        assert _ok(r["fabric"]["whole"]) == {"model": ["weight"], "step": 3}


@pytest.mark.parametrize("side", ["fabric", "trainer"])
def test_what_is_not_ours_is_refused_and_left_alone(ranks, side):
    """A save to a directory holding other files (stock DCP writes into it) or to an existing file (stock replaces
    it with a directory) is refused on every rank naming the path; both stay as they were."""
    cases = ["foreign_dir", "foreign_file"] if side == "fabric" else ["foreign_dir"]
    for r in ranks:
        for case in cases:
            got = r[side][case]
            assert "CheckpointingError" in got["types"] and "refusing to replace it" in got["message"], got
            assert ("foreign" if case == "foreign_dir" else "file.pt") in got["message"]
        assert r["foreign"] == ["notes.txt"] and r["file"] == "not a checkpoint"


@pytest.mark.parametrize("side", ["fabric", "trainer"])
def test_a_directory_with_no_checkpoint_is_refused_naming_it(ranks, side):
    """A load from an empty directory (stock: ``ValueError`` "does not point to a valid checkpoint") fails on every
    rank with our ``IncompleteCheckpointError`` naming the path and what is missing."""
    for r in ranks:
        got = r[side]["load_empty"]
        assert "IncompleteCheckpointError" in got["types"], got
        assert os.path.join(r["base"], "empty") in got["message"] and "metadata.json" in got["message"]


def test_fabric_a_missing_path_is_file_not_found(ranks):
    """A load from a path that does not exist is a ``FileNotFoundError`` naming it, on every rank."""
    for r in ranks:
        got = r["fabric"]["load_missing"]
        assert "FileNotFoundError" in got["types"] and "nowhere" in got["message"], got


def test_fabric_load_raw_loads_a_full_state_dict_file_into_the_sharded_module(ranks):
    """``fabric.load_raw(file, model)`` (what Lightning's tests check stock with): the module's whole weights are the
    file's, on every rank; a file missing a key is refused naming it (strict, as stock)."""
    torch.manual_seed(7)
    want = nn.Linear(4, 4).state_dict()
    for r in ranks:
        _ok(r["fabric"]["raw"])
        assert set(r["fabric"]["raw_full"]) == set(want)
        assert all(torch.equal(r["fabric"]["raw_full"][k], want[k]) for k in want)
        partial = r["fabric"]["raw_partial"]
        assert "KeyError" in partial["types"] and "bias" in partial["message"], partial


def test_fabric_load_raw_refuses_an_optimizer_and_a_directory(ranks):
    """As stock: an optimizer alone is a ``NotImplementedError``, a directory (ours included) a ``ValueError``
    saying a single full state-dict file is needed."""
    for r in ranks:
        opt = r["fabric"]["raw_optimizer"]
        assert "NotImplementedError" in opt["types"] and "single optimizer" in opt["message"], opt
        folder = r["fabric"]["raw_directory"]
        assert "ValueError" in folder["types"] and "single file" in folder["message"], folder
