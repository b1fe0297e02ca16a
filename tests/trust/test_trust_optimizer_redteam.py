"""The optimizer's state through a checkpoint (``lightning_distckpt.optim`` under DistCheckpointStrategy /
FabricDistCheckpointStrategy, torch's state-dict API under the ModelParallel strategies): what a red-team
probe found.

* The fresh state ``optim`` builds as a load's template (Adam's moments, SGD's momentum buffer) came from
  ``calloc`` through ``torch.from_numpy`` from 1 MiB on: its storage was not resizable for good, and the
  optimizer kept it for the rest of training (``exp_avg.resize_`` or ``untyped_storage().resize_(0)``:
  "Trying to resize storage that is not resizable"). Now torch's own zeros, as the first step makes them
  (and, measured here, no slower: the load's first writes into untouched ``calloc`` pages cost more than
  the zeroing saved).
* A model entry that is a factory bound to its tensor (``shard_dtensors`` / ``shard_tensors`` of a state
  dict of DTensor or plain parameters, as the docs advise for code that calls the save steps itself): the
  optimizer's state reused the parameter's factory as it was, whose merge puts the loaded values into the
  tensor it was made for. For DTensors (FSDP2) a load wrote each ``exp_avg`` / ``exp_avg_sq`` into the
  *parameter* and handed the parameter back as the optimizer's moments: parameters and state both wrong,
  silently. For plain tensors the state's entries also carried the parameter's tree place, and every
  load of such a checkpoint was refused (FormatError). The factory is now bound to the state.
* The checkpoint's hyper-parameters are restored (as torch's ``load_state_dict`` does) but the state the
  load read is what this optimizer's asked for. ``momentum=0.9`` saved over an ``SGD(momentum=0)``: its
  momentum buffers were never read and SGD went on with momentum 0.9 from empty buffers, silently not the
  saved run; ``amsgrad=True`` over ``Adam(amsgrad=False)``: ``KeyError: 'max_exp_avg_sq'`` at the first
  step; Adam's groups over an SGD (another class, no state to tell): ``KeyError: 'momentum'`` at the
  first step. Under both strategy families. Now a CheckpointingError at the restore naming what differs,
  the optimizer left as it was.
* Building the sharded state of an optimizer with parameters that had no state yet (not used so far, or a
  save before the first step) made their state and left it in the live optimizer: for NAdam, Rprop, ASGD
  and SGD with ``dampening`` a first step from zeros is not a first step from nothing, so the run that
  *saved* went on differently from one that did not, and its resumes too. Now the made state is held by
  the saved tree only, the checkpoint lists those parameters (``no_state``) and a restore leaves them
  without state, as torch had them.
* ModelParallel (FSDP2) checkpoint of such a run, resumed non-strict (``strict=False`` /
  ``strict_loading=False``; a strict one refuses it, as torch's ``set_optimizer_state_dict`` does): the
  parameter got the fresh template's state, torch's zero-gradient init step, and Adam went on from step 2,
  silently not the saved run. Now it has no state, as when it was saved: bit-exact.

Found sound (not repeated here): a stored ``step`` of another shape or an integer dtype, a tensor of
another shape than its parameter, a missing state (all refused by the load's template checks); states
for parameters that do not exist and extra state names (ignored / kept as torch keeps them); tied and
frozen parameters under both strategy families (bit-exact resume); DTensor templates of other
placements, ``Shard(-1)``, 0-d DTensors; one DTensor per rank on its own one-rank mesh (refused at save:
"a main replica on ranks 0 and 1"). torch's own ``distribute_tensor`` on a mesh of non-ascending ranks
(``DeviceMesh("cpu", [1, 0])``) scatters by group rank against its mesh coordinates; that DTensor is
saved as torch describes it (``compute_local_shape_and_global_offset``), as DCP does.

2-process gloo groups (a hang guard: the group's timeout, GROUP_TIMEOUT_S); Fabric runs in those
processes, launched as torchrun would start them.
"""

import os
import warnings

import pytest
import torch
from torch import nn

import lightning_distckpt as ldc
from lightning_distckpt.core.errors import CheckpointingError
from lightning_distckpt.core.plain_tensors import shard_tensors
from lightning_distckpt.lightning.parallel import module_sharded_state_dict
from dist_utils import run_distributed
from trust.hostile import resizable as _resizable

GROUP_TIMEOUT_S = 30


# ------------------------------------------------------------------ helpers (one process)
def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))


def _tree(model: nn.Module, opt: torch.optim.Optimizer) -> dict:
    msd = module_sharded_state_dict(model, "model.")
    return {"model": msd, "optimizer": ldc.optim.optimizer_sharded_state_dict(opt, msd)}


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    for s in steps:
        x = torch.randn(5, 4, generator=torch.Generator().manual_seed(s))
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()


# ------------------------------------------------------------------ fresh state is torch's own
def test_restored_and_template_state_stays_resizable(tmp_path):
    """Was: "Trying to resize storage that is not resizable" on every state of 1 MiB and more."""
    def big(seed):
        torch.manual_seed(seed)
        return nn.Linear(512, 600)  # 1.2 MB weight
    src = big(0)
    opt = torch.optim.AdamW(src.parameters(), lr=0.1, amsgrad=True)
    src(torch.randn(2, 512)).sum().backward()
    opt.step()
    ldc.save(_tree(src, opt), str(tmp_path / "ck"))
    dst = big(1)
    again = torch.optim.AdamW(dst.parameters(), lr=0.1, amsgrad=True)
    loaded = ldc.load(_tree(dst, again), str(tmp_path / "ck"))
    ldc.optim.restore_optimizer_state(again, loaded["optimizer"])
    state = again.state[dst.weight]
    assert torch.equal(state["exp_avg"], opt.state[src.weight]["exp_avg"])
    assert [k for k in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") if not _resizable(state[k])] == []
    fresh = torch.optim.SGD(big(2).parameters(), lr=0.1, momentum=0.9)
    ldc.optim.init_optimizer_state(fresh)
    buf = fresh.state[fresh.param_groups[0]["params"][0]]["momentum_buffer"]
    buf.untyped_storage().resize_(0)  # as FSDP frees a storage
    assert buf.untyped_storage().nbytes() == 0


# ------------------------------------------------------------------ a factory bound to its parameter
def test_plain_tensor_factories_load_the_state_into_the_state(tmp_path):
    """Model entries from ``shard_tensors`` (plain parameters): the state's entries were the parameter's
    factory, its tree place included, and the load refused the checkpoint (FormatError: plain_tensors
    'optimizer.state.exp_avg.0.weight' must be the path of ...)."""
    src = _model(0)
    opt = torch.optim.Adam(src.parameters(), lr=0.1)
    _train(src, opt, range(2))
    msd = shard_tensors(src.state_dict(keep_vars=True), 0)
    ldc.save({"model": msd, "optimizer": ldc.optim.optimizer_sharded_state_dict(opt, msd)}, str(tmp_path / "ck"))
    dst = _model(1)
    again = torch.optim.Adam(dst.parameters(), lr=0.1)
    msd = shard_tensors(dst.state_dict(keep_vars=True), 0)
    loaded = ldc.load({"model": msd, "optimizer": ldc.optim.optimizer_sharded_state_dict(again, msd)},
                      str(tmp_path / "ck"))
    ldc.optim.restore_optimizer_state(again, loaded["optimizer"])
    for (name, p), q in zip(src.named_parameters(), dst.parameters()):
        assert torch.equal(q, p), name
        for k in ("exp_avg", "exp_avg_sq"):
            assert again.state[q][k] is not q and torch.equal(again.state[q][k], opt.state[p][k]), (name, k)


# ------------------------------------------------------------------ hyper-parameters the optimizer cannot step with
OPTIMIZERS = {
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.01),
    "adam_amsgrad": lambda ps: torch.optim.Adam(ps, lr=0.01, amsgrad=True),
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.01),
}
MISMATCHES = [("sgd_momentum", "sgd", r"has \{'momentum': 0.9\}, which keeps state \['momentum_buffer'\]"),
              ("adam_amsgrad", "adam", r"has \{'amsgrad': True\}, which keeps state \['max_exp_avg_sq'\]"),
              ("adam", "sgd", r"has no \['dampening', 'momentum'\], which SGD steps with .*another optimizer class")]


@pytest.fixture(scope="module")
def saved_optimizers(tmp_path_factory):
    root = tmp_path_factory.mktemp("optimizers")
    for name, make in OPTIMIZERS.items():
        model = _model(0)
        opt = make(model.parameters())
        _train(model, opt, range(2))
        ldc.save(_tree(model, opt), str(root / name))
    return root


@pytest.mark.parametrize("saved,built,says", MISMATCHES, ids=[f"{s}-into-{b}" for s, b, _ in MISMATCHES])
def test_hyper_parameters_the_optimizer_cannot_step_with_are_refused(saved_optimizers, saved, built, says):
    """Was: loaded; then SGD went on with momentum 0.9 from empty buffers (silently), or the first step
    raised KeyError ('max_exp_avg_sq', 'momentum'). Now refused, the optimizer as it was."""
    model = _model(1)
    opt = OPTIMIZERS[built](model.parameters())
    before = [dict(g) for g in opt.param_groups]
    loaded = ldc.load(_tree(model, opt), str(saved_optimizers / saved))
    with pytest.raises(CheckpointingError, match=says):
        ldc.optim.restore_optimizer_state(opt, loaded["optimizer"])
    assert opt.param_groups == before and not opt.state
    _train(model, opt, range(1))  # it still steps


def test_the_same_hyper_parameters_resume_bit_exact(saved_optimizers):
    for name in OPTIMIZERS:  # the checks refuse nothing that resumes
        ref = _model(0)
        ref_opt = OPTIMIZERS[name](ref.parameters())
        _train(ref, ref_opt, range(3))
        model = _model(1)
        opt = OPTIMIZERS[name](model.parameters())
        loaded = ldc.load(_tree(model, opt), str(saved_optimizers / name))
        ldc.optim.restore_optimizer_state(opt, loaded["optimizer"])
        _train(model, opt, range(2, 3))
        assert all(torch.equal(a, b) for a, b in zip(ref.parameters(), model.parameters())), name


def test_a_group_label_the_checkpoint_lacks_is_no_other_class(saved_optimizers):
    """A key of the user's in a group (not a hyper-parameter of the class) may come and go between runs."""
    model = _model(1)
    opt = torch.optim.Adam([{"params": list(model.parameters()), "name": "all"}], lr=0.01)
    loaded = ldc.load(_tree(model, opt), str(saved_optimizers / "adam"))
    ldc.optim.restore_optimizer_state(opt, loaded["optimizer"])
    assert opt.state[model[0].weight]["step"] == 2


# ------------------------------------------------------------------ a save leaves training as it was
class LateHead(nn.Module):
    """``b`` joins the loss from step 2 on: until then torch keeps no optimizer state for it."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 3)

    def forward(self, x: torch.Tensor, step: int) -> torch.Tensor:
        return (self.a(x) + self.b(x)).pow(2).sum() if step >= 2 else self.a(x).pow(2).sum()


LATE = {"nadam": lambda ps: torch.optim.NAdam(ps, lr=0.1),
        "sgd_dampening": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, dampening=0.5),
        "rprop": lambda ps: torch.optim.Rprop(ps, lr=0.1),
        "asgd": lambda ps: torch.optim.ASGD(ps, lr=0.1)}


def _late_run(make, save_to=None, resume_from=None):
    model = LateHead()
    opt = make(model.parameters())
    first = 0
    if resume_from is not None:
        loaded = ldc.load(_tree(model, opt), resume_from)
        ldc.optim.restore_optimizer_state(opt, loaded["optimizer"])
        first = 1
    for s in range(first, 4):
        opt.zero_grad()
        model(torch.randn(2, 3, generator=torch.Generator().manual_seed(s)), s).backward()
        opt.step()
        if save_to is not None and s == 0:
            ldc.save(_tree(model, opt), save_to)
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("name", sorted(LATE))
def test_a_save_before_a_parameters_first_gradient_changes_no_training(tmp_path, name):
    """Was: the saving run and its resumes went on differently from a run without the save."""
    plain = _late_run(LATE[name])
    saving = _late_run(LATE[name], save_to=str(tmp_path / "ck"))
    assert all(torch.equal(a, b) for a, b in zip(plain, saving)), "the save changed the run that saved"
    resumed = _late_run(LATE[name], resume_from=str(tmp_path / "ck"))
    assert all(torch.equal(a, b) for a, b in zip(plain, resumed)), "the resume is not the uninterrupted run"
    stored = ldc.load_common_state_dict(str(tmp_path / "ck"))["optimizer"]["no_state"]
    assert stored == ("model.b.weight", "model.b.bias")


def test_a_malformed_no_state_list_is_refused(tmp_path):
    model = LateHead()
    opt = torch.optim.NAdam(model.parameters(), lr=0.1)
    tree = _tree(model, opt)
    tree["optimizer"]["no_state"] = {"b.weight": 1}  # as a hostile writer's common state would hold it
    ldc.save(tree, str(tmp_path / "ck"))
    loaded = ldc.load(_tree(model, opt), str(tmp_path / "ck"))
    with pytest.raises(CheckpointingError, match="stored 'no_state' is malformed"):
        ldc.optim.restore_optimizer_state(opt, loaded["optimizer"])


# ------------------------------------------------------------------ 2 processes: DTensors and the strategies
def _fabric(rank: int, world: int, strategy) -> "object":
    """Fabric in this process of the group, as torchrun would have started it (the group exists)."""
    from lightning.fabric import Fabric

    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT="1", NODE_RANK="0", LOCAL_WORLD_SIZE=str(world))
    warnings.simplefilter("ignore")
    fabric = Fabric(accelerator="cpu", devices=world, strategy=strategy)
    fabric.launch()
    return fabric


def _fsdp(model: nn.Module, mesh) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    fully_shard(model, mesh=mesh["data_parallel"])
    return model


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _dtensor_factories(root: str) -> dict:
    """FSDP2 parameters keyed through ``shard_dtensors``, the optimizer by ``optim``: saved, loaded fresh."""
    from lightning_distckpt.core.dtensors import shard_dtensors
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import init_device_mesh

    def build(seed):
        torch.manual_seed(seed)
        model = nn.Linear(4, 6)
        fully_shard(model, mesh=init_device_mesh("cpu", (torch.distributed.get_world_size(),)))
        return model, torch.optim.Adam(model.parameters(), lr=0.1)

    def tree(model, opt):
        msd = shard_dtensors(model.state_dict(keep_vars=True))
        return {"model": msd, "optimizer": ldc.optim.optimizer_sharded_state_dict(opt, msd)}

    model, opt = build(0)
    model(torch.randn(3, 4, generator=torch.Generator().manual_seed(0))).sum().backward()
    opt.step()
    ldc.save(tree(model, opt), f"{root}/dtensors")
    again, again_opt = build(1)
    loaded = ldc.load(tree(again, again_opt), f"{root}/dtensors")
    ldc.optim.restore_optimizer_state(again_opt, loaded["optimizer"])
    out = {}
    for (name, p), q in zip(model.named_parameters(), again.parameters()):
        out[name] = torch.equal(_full(q), _full(p))
        for k in ("exp_avg", "exp_avg_sq"):
            out[f"{name}.{k}"] = again_opt.state[q][k] is not q and torch.equal(_full(again_opt.state[q][k]),
                                                                               _full(opt.state[p][k]))
    return out


def _mp_run(fabric, make, save_to=None, resume_from=None, strict=True, save_at=0):
    """LateHead under FSDP2 (Fabric's ModelParallel strategy): 4 steps, saved after step ``save_at``."""
    model = fabric.setup_module(LateHead())
    opt = fabric.setup_optimizers(make(model.parameters()))
    first = 0
    if resume_from is not None:
        fabric.load(resume_from, {"model": model, "optimizer": opt}, strict=strict)
        first = 1
    for s in range(first, 4):
        fabric.backward(model(torch.randn(2, 3, generator=torch.Generator().manual_seed(s)), s))
        opt.step()
        opt.zero_grad()
        if save_to is not None and s == save_at:
            fabric.save(save_to, {"model": model, "optimizer": opt})
    return [_full(p) for p in model.parameters()]


def _refusal(fabric, make, path) -> str:
    model = fabric.setup_module(LateHead())
    opt = fabric.setup_optimizers(make(model.parameters()))
    try:
        fabric.load(path, {"model": model, "optimizer": opt})
    except CheckpointingError as e:
        return str(e)
    try:  # loaded: does it step?
        fabric.backward(model(torch.randn(2, 3, generator=torch.Generator().manual_seed(3)), 3))
        opt.step()
        return "loaded, and steps"
    except Exception as e:  # noqa: BLE001 - what the old code raised at the first step
        return f"loaded; the first step raised {type(e).__name__}: {e}"


def _two_ranks(rank: int, world: int, root: str) -> dict:
    from lightning_distckpt.lightning.fabric_model_parallel import FabricDistCheckpointModelParallelStrategy

    out = {"dtensor_factories": _dtensor_factories(root)}
    fabric = _fabric(rank, world, FabricDistCheckpointModelParallelStrategy(_fsdp, world, 1))
    adam = OPTIMIZERS["adam"]
    plain = _mp_run(fabric, adam)
    _mp_run(fabric, adam, save_to=f"{root}/adam")
    out["nonstrict_resume_exact"] = all(torch.equal(a, b) for a, b in
                                        zip(plain, _mp_run(fabric, adam, resume_from=f"{root}/adam", strict=False)))
    for name in ("adam", "adam_amsgrad", "sgd_momentum"):  # every parameter with state: step 2 used b
        _mp_run(fabric, OPTIMIZERS[name], save_to=f"{root}/{name}_all", save_at=2)
    out["refused"] = {f"{s}-into-{b}": _refusal(fabric, OPTIMIZERS[b], f"{root}/{s}_all") for s, b, _ in MISMATCHES}
    return out


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return run_distributed(_two_ranks, 2, str(tmp_path_factory.mktemp("two_ranks")), timeout_s=GROUP_TIMEOUT_S)


def test_dtensor_factories_load_the_state_into_the_state(two_ranks):
    """Was: every parameter and moment False (the moments written into the parameters)."""
    for out in two_ranks:
        assert out["dtensor_factories"] and all(out["dtensor_factories"].values()), out["dtensor_factories"]


def test_model_parallel_nonstrict_resume_leaves_a_stateless_parameter_without_state(two_ranks):
    """Was: ``b`` (no state when saved) got the template's init-step state; Adam went on from step 2."""
    assert [out["nonstrict_resume_exact"] for out in two_ranks] == [True, True]


@pytest.mark.parametrize("saved,built,says", MISMATCHES, ids=[f"{s}-into-{b}" for s, b, _ in MISMATCHES])
def test_model_parallel_refuses_hyper_parameters_the_optimizer_cannot_step_with(two_ranks, saved, built, says):
    """Was: loaded; then silently on with empty momentum buffers, or KeyError at the first step."""
    import re

    for out in two_ranks:
        got = out["refused"][f"{saved}-into-{built}"]
        assert re.search(says, got) and "optimizer 'optimizer'" in got, got
