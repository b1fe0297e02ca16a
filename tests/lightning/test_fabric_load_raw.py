"""``fabric.load_raw(path, obj)`` under our two Fabric strategies, as stock Fabric has it, with the file read by our
own reader; ``save_distributed_checkpoint`` as the stock ModelParallel constructors take it; ``fabric.save`` with a
state that is not a dict.

Real ``Fabric`` runs on 2 gloo processes: ``FabricDistCheckpointStrategy`` (DDP) at TP 1 and at TP 2 (a
column-parallel layer: each rank reads its slices of the full file), and ``FabricDistCheckpointModelParallelStrategy``
with an FSDP2 (``fully_shard``) module. Stock semantics checked: DDP loads ``module.load_state_dict(sd, strict)`` and
``optimizer.load_state_dict(sd)``; ModelParallel puts the full state dict into the DTensors (strict: a missing key is
a ``KeyError``, extra keys ignored) and refuses an optimizer (``NotImplementedError``); a directory is a ``ValueError``
saying a single file is needed. Hostile files (a pickle calling ``os.system``, a zip record that lies about its
storage, a link to ``/etc/passwd``, a FIFO) are our clear errors on every rank, and no code runs.
"""

from __future__ import annotations

import os
import sys
import threading
from datetime import timedelta
from typing import Any, Callable, Dict, List

import pytest
import torch
from torch import nn

from dist_utils import free_port, run_distributed
from special_files import BOUND_S, make_special, unblock_fifos

GROUP_TIMEOUT_S = 60  # a hang guard only: every wait below is on a collective
HOSTILE = ("evil", "lying", "passwd_link", "fifo")


class Evil:
    """A pickled value whose unpickling runs ``os.system`` (touching a marker file: proof if it ran)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (os.system, (f"touch {self.marker}",))


def _outcome(fn: Callable[[], Any]) -> Dict[str, Any]:
    """``fn()``'s value, or the exception's type names (its MRO) and message."""
    try:
        return {"ok": fn()}
    except Exception as e:  # the test asserts on what was raised
        return {"types": [c.__name__ for c in type(e).__mro__], "message": str(e)}


def _linear(seed: int) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(4, 4)


def _files(base: str) -> Dict[str, str]:
    """The files the runs load (built by the test process before the ranks start)."""
    paths = {n: os.path.join(base, n) for n in ("raw.pt", "raw.safetensors", "partial.pt", "extra.pt", "fabric.pt",
                                               "optimizer.pt", "evil", "lying", "passwd_link", "fifo", "our_dir")}
    sd = _linear(7).state_dict()
    torch.save(sd, paths["raw.pt"])
    from safetensors.torch import save_file
    save_file(sd, paths["raw.safetensors"])
    torch.save({"weight": sd["weight"]}, paths["partial.pt"])
    torch.save({**sd, "unused": torch.ones(2)}, paths["extra.pt"])
    torch.save({"model": sd, "step": 3}, paths["fabric.pt"])  # what stock Fabric DDP's fabric.save writes
    model = _linear(7)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    torch.save(opt.state_dict(), paths["optimizer.pt"])
    torch.save({"weight": Evil(os.path.join(base, "PWNED")), "bias": sd["bias"]}, paths["evil"])
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "trust"))
    from test_trust_foreign_redteam import claim_more  # the real writer's archive, a record claimed past its bytes

    claim_more(paths["lying"], 64)
    make_special(paths["passwd_link"], "link", "/etc/passwd")
    make_special(paths["fifo"], "fifo")
    os.makedirs(paths["our_dir"])
    return paths


def _hostile(fabric: Any, model: Any, paths: Dict[str, str]) -> Dict[str, Any]:
    return {name: _outcome(lambda: fabric.load_raw(paths[name], model)) for name in HOSTILE}


def _ddp(rank: int, paths: Dict[str, str], tp: int) -> Dict[str, Any]:
    from lightning.fabric import Fabric

    from lightning_distckpt.lightning import FabricDistCheckpointStrategy

    strategy = FabricDistCheckpointStrategy(tensor_parallel_size=tp, timeout=timedelta(seconds=GROUP_TIMEOUT_S))
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    out: Dict[str, Any] = {}
    if tp > 1:  # a column-parallel layer: each rank holds 2 of the 4 output rows
        from example_layers import ColumnParallelLinear

        torch.manual_seed(0)
        layer = ColumnParallelLinear(4, 4, strategy.parallel_state)
        model = fabric.setup_module(layer)
        out["raw"] = _outcome(lambda: fabric.load_raw(paths["raw.pt"], model))
        out["local"] = {k: v.detach().clone() for k, v in layer.state_dict().items()}
        out["tp_rank"] = strategy.parallel_state.tp_rank
        opt = fabric.setup_optimizers(torch.optim.Adam(model.parameters()))
        out["optimizer"] = _outcome(lambda: fabric.load_raw(paths["optimizer.pt"], opt))
        return out
    model = fabric.setup_module(_linear(0))
    opt = fabric.setup_optimizers(torch.optim.Adam(model.parameters(), lr=0.1))
    out["raw"] = _outcome(lambda: fabric.load_raw(paths["raw.pt"], model))
    out["after_raw"] = {k: v.clone() for k, v in model.state_dict().items()}
    out["safetensors"] = _outcome(lambda: fabric.load_raw(paths["raw.safetensors"], model))
    out["after_safetensors"] = {k: v.clone() for k, v in model.state_dict().items()}
    out["optimizer"] = _outcome(lambda: fabric.load_raw(paths["optimizer.pt"], opt))
    out["optimizer_state"] = opt.optimizer.state_dict()
    out.update(_common_refusals(fabric, model, paths))
    out["wrong_optimizer_file"] = _outcome(lambda: fabric.load_raw(paths["raw.pt"], opt))
    with torch.no_grad():
        model.bias.fill_(5.0)
    out["partial_lenient"] = _outcome(lambda: fabric.load_raw(paths["partial.pt"], model, strict=False))
    out["after_partial"] = {k: v.clone() for k, v in model.state_dict().items()}
    out["extra"] = _outcome(lambda: fabric.load_raw(paths["extra.pt"], model))
    return out


def _common_refusals(fabric: Any, model: Any, paths: Dict[str, str]) -> Dict[str, Any]:
    """What both strategies refuse alike: a missing key (strict), a fabric.save file, a directory, a path that does
    not exist, the hostile files; ``fabric.save`` of a state that is not a dict."""
    out = {"partial": _outcome(lambda: fabric.load_raw(paths["partial.pt"], model)),
           "fabric_file": _outcome(lambda: fabric.load_raw(paths["fabric.pt"], model, strict=False)),
           "directory": _outcome(lambda: fabric.load_raw(paths["our_dir"], model)),
           "nowhere": _outcome(lambda: fabric.load_raw(paths["our_dir"] + "_nowhere", model)),
           "save_module_alone": _outcome(lambda: fabric.save(paths["our_dir"] + "_save", model)),
           "save_list": _outcome(lambda: fabric.save(paths["our_dir"] + "_save", [model]))}
    guard = threading.Timer(BOUND_S, unblock_fifos, (os.path.dirname(paths["fifo"]),))  # a hang bound only
    guard.start()
    try:
        out["hostile"] = _hostile(fabric, model, paths)
    finally:
        guard.cancel()
    return out


def _fsdp(model: nn.Module, mesh: Any) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    return fully_shard(model, mesh=mesh["data_parallel"])


def _full(module: nn.Module) -> Dict[str, torch.Tensor]:
    """The module's weights, whole (collective for DTensors)."""
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in module.state_dict().items()}


def _model_parallel(rank: int, paths: Dict[str, str]) -> Dict[str, Any]:
    from lightning.fabric import Fabric

    from lightning_distckpt.lightning import FabricDistCheckpointModelParallelStrategy

    strategy = FabricDistCheckpointModelParallelStrategy(_fsdp, data_parallel_size=2, tensor_parallel_size=1,
                                                         timeout=timedelta(seconds=GROUP_TIMEOUT_S))
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    model = fabric.setup_module(_linear(0))
    opt = fabric.setup_optimizers(torch.optim.Adam(model.parameters()))
    out: Dict[str, Any] = {"raw": _outcome(lambda: fabric.load_raw(paths["raw.pt"], model))}
    out["after_raw"] = _full(model)
    out["extra"] = _outcome(lambda: fabric.load_raw(paths["extra.pt"], model))
    out["optimizer"] = _outcome(lambda: fabric.load_raw(paths["optimizer.pt"], opt))
    out.update(_common_refusals(fabric, model, paths))
    with torch.no_grad():
        model.bias.fill_(5.0)
    out["partial_lenient"] = _outcome(lambda: fabric.load_raw(paths["partial.pt"], model, strict=False))
    out["after_partial"] = _full(model)
    return out


def _checks(rank: int, world: int, paths: Dict[str, str], port: int) -> Dict[str, Any]:
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))  # Fabric joins the group run_distributed made
    import lightning_distckpt

    return {"package": lightning_distckpt.__file__, "ddp": _ddp(rank, paths, 1), "ddp_tp": _ddp(rank, paths, 2),
            "model_parallel": _model_parallel(rank, paths)}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> List[Dict[str, Any]]:
    base = str(tmp_path_factory.mktemp("load_raw"))
    paths = _files(base)
    out = run_distributed(_checks, 2, paths, free_port(), timeout_s=120)
    print("lightning_distckpt used by the ranks:", out[0]["package"])
    if os.environ.get("LDC_SHOW_OUTCOMES"):
        for name in ("ddp", "ddp_tp", "model_parallel"):
            for key, value in out[0][name].items():
                print(name, key, value if not isinstance(value, dict) or "message" not in value else
                      (value["types"][0], value["message"]))
    for r in out:
        r["base"] = base
    return out


def _ok(outcome: Dict[str, Any]) -> Any:
    assert "ok" in outcome, outcome
    return outcome["ok"]


def _refused(outcome: Dict[str, Any], kind: str, *words: str) -> None:
    assert kind in outcome.get("types", ()), outcome
    assert all(w in outcome["message"] for w in words), outcome


def _want() -> Dict[str, torch.Tensor]:
    return _linear(7).state_dict()


def _equal(got: Dict[str, torch.Tensor], want: Dict[str, torch.Tensor]) -> bool:
    return set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)


def test_ddp_load_raw_loads_a_state_dict_file_into_the_module(ranks):
    """Under the DDP strategy (stock Fabric DDP loads it; ours refused it), a ``torch.save(module.state_dict())``
    file and a ``.safetensors`` file load into the module on every rank, bit-exact."""
    for r in ranks:
        _ok(r["ddp"]["raw"])
        assert _equal(r["ddp"]["after_raw"], _want())
        _ok(r["ddp"]["safetensors"])
        assert _equal(r["ddp"]["after_safetensors"], _want())


def test_ddp_load_raw_reads_each_ranks_tensor_parallel_slices(ranks):
    """At TP 2 each rank's column-parallel shard holds its rows of the full file's tensors; a bare optimizer is
    refused there (its file's moments are whole, the parameters shards), naming what to do."""
    want = _want()
    for r in ranks:
        got = r["ddp_tp"]
        _ok(got["raw"])
        rows = slice(2 * got["tp_rank"], 2 * got["tp_rank"] + 2)
        assert torch.equal(got["local"]["weight"], want["weight"][rows])
        assert torch.equal(got["local"]["bias"], want["bias"][rows])
        _refused(got["optimizer"], "ArgumentError", "tensor_parallel_size=1", "fabric.load")


def test_ddp_load_raw_of_an_optimizer_loads_its_state_dict(ranks):
    """``fabric.load_raw(file, optimizer)`` under DDP: ``optimizer.load_state_dict`` of the file, as stock; a file
    holding a module's state dict instead is refused naming what it holds."""
    torch.manual_seed(7)
    model = nn.Linear(4, 4)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    want = opt.state_dict()
    for r in ranks:
        _ok(r["ddp"]["optimizer"])
        got = r["ddp"]["optimizer_state"]
        assert got["param_groups"] == want["param_groups"]
        for i, state in want["state"].items():
            assert all(torch.equal(got["state"][i][k], v) for k, v in state.items())
        _refused(r["ddp"]["wrong_optimizer_file"], "FormatError", "no optimizer state dict", "'bias', 'weight'")


def test_strictness_is_stocks(ranks):
    """strict: a key the file lacks is refused naming it (both; a ``KeyError`` as stock ModelParallel's); a key the
    module lacks is refused under DDP (``load_state_dict``) and ignored under ModelParallel, as stock. strict=False
    loads what the file holds and keeps the rest."""
    want = _want()
    for r in ranks:
        for name in ("ddp", "model_parallel"):
            _refused(r[name]["partial"], "KeyError", "'bias'", "strict=False")
            _ok(r[name]["partial_lenient"])
            assert torch.equal(r[name]["after_partial"]["weight"], want["weight"])
            assert torch.equal(r[name]["after_partial"]["bias"], torch.full((4,), 5.0))
        _refused(r["ddp"]["extra"], "CheckpointingError", "unused")
        _ok(r["model_parallel"]["extra"])


def test_model_parallel_load_raw_fills_the_sharded_module_and_refuses_an_optimizer(ranks):
    """Under ModelParallel (FSDP2) the full file's tensors become the module's DTensors (whole weights bit-exact on
    every rank); an optimizer alone is stock's ``NotImplementedError``."""
    for r in ranks:
        _ok(r["model_parallel"]["raw"])
        assert _equal(r["model_parallel"]["after_raw"], _want())
        _refused(r["model_parallel"]["optimizer"], "NotImplementedError", "single optimizer")


def test_files_that_are_no_raw_state_dict_are_refused_with_what_to_call(ranks):
    """A ``fabric.save`` file (even non-strict, where stock silently loads nothing), a directory (a ``ValueError``
    saying a single file is needed, as stock) and a missing path (a ``FileNotFoundError``), on both strategies."""
    for r in ranks:
        for name in ("ddp", "model_parallel"):
            got = r[name]
            _refused(got["fabric_file"], "MissingKeysError", "no raw state dict", "fabric.load(path, {'model': model})")
            _refused(got["directory"], "ValueError", "single file", "fabric.load(path, {'model': model})",
                     "load_module_weights")
            _refused(got["nowhere"], "FileNotFoundError", "does not exist")


def test_hostile_files_are_clear_errors_on_every_rank_and_run_no_code(ranks):
    """A pickle calling ``os.system``, a zip record claiming more than it holds, a link to ``/etc/passwd`` and a FIFO:
    our errors naming the file on every rank of both strategies (no hang, no stock ``torch.load``), and the
    ``os.system`` call never ran."""
    want = {"evil": ("UnsafeContentError", "posix.system"), "lying": ("FormatError", "claims 64 elements"),
            "passwd_link": ("FormatError", "passwd_link is not a checkpoint"),
            "fifo": ("FormatError", "is a FIFO (named pipe), not a regular file")}
    for r in ranks:
        for name in ("ddp", "model_parallel"):
            for file, (kind, words) in want.items():
                _refused(r[name]["hostile"][file], kind, words)
    assert not os.path.exists(os.path.join(ranks[0]["base"], "PWNED"))


def test_save_of_a_state_that_is_not_a_dict_names_the_type(ranks):
    """``fabric.save(path, model)`` / ``fabric.save(path, [model])``: an ``ArgumentTypeError`` naming the type and
    what to pass (it was "'Linear' object is not iterable"), on both strategies, nothing written."""
    for r in ranks:
        for name in ("ddp", "model_parallel"):
            _refused(r[name]["save_module_alone"], "ArgumentTypeError", "state must be a dict", "got an instance of",
                     "fabric.save(path, {'model': model, 'optimizer': optimizer, 'step': step})")
            _refused(r[name]["save_list"], "ArgumentTypeError", "got an instance of list")
    assert not os.path.exists(os.path.join(ranks[0]["base"], "our_dir_save"))


def test_model_parallel_constructors_take_save_distributed_checkpoint_true_only():
    """What a user swapping stock ``ModelParallelStrategy`` for ours passes: ``True`` is taken (what we always do),
    ``False`` refused saying our checkpoints are always sharded and how to get one file, a non-bool refused."""
    from lightning_distckpt.core.errors import ArgumentError, ArgumentTypeError
    from lightning_distckpt.lightning import (DistCheckpointModelParallelStrategy,
                                              FabricDistCheckpointModelParallelStrategy)

    makers = {"DistCheckpointModelParallelStrategy": DistCheckpointModelParallelStrategy,
              "FabricDistCheckpointModelParallelStrategy": lambda **kw: FabricDistCheckpointModelParallelStrategy(
                  _fsdp, **kw)}
    for name, make in makers.items():
        assert make(save_distributed_checkpoint=True)._save_distributed_checkpoint is True
        with pytest.raises(ArgumentError, match=f"{name}.save_distributed_checkpoint=False.: .*always sharded") as e:
            make(save_distributed_checkpoint=False)
        assert "lightning_distckpt.export.to_torch_file" in str(e.value) and "convert" in str(e.value)
        with pytest.raises(ArgumentTypeError, match="must be a bool, got str 'no'"):
            make(save_distributed_checkpoint="no")
