"""Optimizer state sharded like the model: train, save model + optimizer, resume under the same
and other TP/DP splits (real gloo groups) and compare with an uninterrupted run.

Tensor parallelism is simulated: each rank keeps its row/column shards of the Linear weights as
its parameters, but every step computes the loss with the full tensors (all-gathered) and sets
each shard's gradient to the matching slice of the full gradient. All ranks therefore do the
same math as a single process, and Adam being elementwise, any split gives the same trajectory.
"""

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

import lightning_distckpt as ldc
from dist_utils import run_distributed

HIDDEN = 8
# model key -> TP axis (None: replicated over TP). fc1 column-parallel, fc2 row-parallel.
TP_AXIS = {"fc1.weight": 0, "fc1.bias": 0, "fc2.weight": 1, "fc2.bias": None}
OPTIMIZERS = {
    "adam": lambda params: torch.optim.Adam(params, lr=0.05),
    "adamw": lambda params: torch.optim.AdamW(params, lr=0.05, weight_decay=0.1, amsgrad=True),
    "sgd": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9, nesterov=True),
}


def full_init(seed):
    g = torch.Generator().manual_seed(seed)
    shapes = {"fc1.weight": (HIDDEN, 4), "fc1.bias": (HIDDEN,), "fc2.weight": (3, HIDDEN), "fc2.bias": (3,)}
    return {k: torch.randn(s, generator=g) for k, s in shapes.items()}


class ShardedMLP(nn.Module):
    """Linear(4, 8) -> tanh -> Linear(8, 3), holding rank ``tp_rank``'s shards of a TP=``tp`` split."""

    def __init__(self, full, tp, tp_rank, dp_rank):
        super().__init__()
        self.tp, self.tp_rank, self.dp_rank = tp, tp_rank, dp_rank
        self.fc1 = nn.Linear(4, HIDDEN // tp)
        self.fc2 = nn.Linear(HIDDEN // tp, 3)
        with torch.no_grad():
            for name, p in self.named_parameters():
                p.copy_(self.local(name, full[name]))

    def local(self, name, full_tensor):
        axis = TP_AXIS[name]
        return full_tensor if axis is None else full_tensor.chunk(self.tp, dim=axis)[self.tp_rank]

    def sharded_state_dict(self, prefix="model."):
        out = {}
        for name, p in self.state_dict(keep_vars=True).items():
            axis = TP_AXIS[name]
            if axis is None:  # replicated over TP and DP
                out[name] = ldc.ShardedTensor.from_rank_offsets(prefix + name, p, replica_id=(self.tp_rank, self.dp_rank))
            else:
                out[name] = ldc.ShardedTensor.from_rank_offsets(
                    prefix + name, p, (axis, self.tp_rank, self.tp), replica_id=(0, self.dp_rank))
        return out


def layout(rank, world, tp):
    return rank % tp, rank // tp  # (tp_rank, dp_rank): TP ranks are adjacent


def gather_full(local, tp):
    """Full tensors from every rank's ``{name: local shard}`` (TP ranks 0..tp-1 hold one copy)."""
    if dist.is_initialized():
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, local)
    else:
        parts = [local]
    return {n: parts[0][n] if TP_AXIS[n.split(":")[-1]] is None
            else torch.cat([parts[r][n] for r in range(tp)], dim=TP_AXIS[n.split(":")[-1]]) for n in local}


def train(model, opt, steps, start):
    """``steps`` steps of full-tensor math; batch ``s`` is the same on every rank and every run."""
    for s in range(start, start + steps):
        full = {k: v.requires_grad_() for k, v in
                gather_full({n: p.detach().clone() for n, p in model.named_parameters()}, model.tp).items()}
        g = torch.Generator().manual_seed(1000 + s)
        x, y = torch.randn(6, 4, generator=g), torch.randn(6, 3, generator=g)
        h = torch.tanh(x @ full["fc1.weight"].T + full["fc1.bias"])
        loss = ((h @ full["fc2.weight"].T + full["fc2.bias"] - y) ** 2).mean()
        loss.backward()
        for n, p in model.named_parameters():
            p.grad = model.local(n, full[n].grad).clone()
        opt.step()
        opt.zero_grad()


def full_params(model):
    return gather_full({n: p.detach().clone() for n, p in model.named_parameters()}, model.tp)


def full_opt_state(model, opt):
    """``{"<state>:<param>": full tensor}`` for per-parameter state, plus scalar state as is."""
    local, scalars = {}, {}
    for n, p in model.named_parameters():
        for s, v in opt.state[p].items():
            if v.dim():
                local[f"{s}:{n}"] = v.clone()
            else:
                scalars[f"{s}:{n}"] = v.clone()
    return gather_full(local, model.tp), scalars


def build(kind, full, rank, world, tp):
    tp_rank, dp_rank = layout(rank, world, tp)
    model = ShardedMLP(full, tp, tp_rank, dp_rank)
    return model, OPTIMIZERS[kind](model.parameters())


def checkpoint_sd(model, opt, **kw):
    msd = model.sharded_state_dict()
    return {"model": msd, "optimizer": ldc.optim.optimizer_sharded_state_dict(opt, msd, **kw)}


# -- process bodies -------------------------------------------------------------------------
def _train_save(rank, world, tp, kind, path, steps, more):
    """Train ``steps``, save, then keep training ``more`` steps uninterrupted."""
    model, opt = build(kind, full_init(0), rank, world, tp)
    train(model, opt, steps, 0)
    ldc.save(checkpoint_sd(model, opt), path)
    saved_state = copy.deepcopy(opt.state_dict())
    state = full_opt_state(model, opt)
    train(model, opt, more, steps)
    return {"params": full_params(model), "optimizer_state_dict": saved_state, "state": state}


def _resume(rank, world, tp, kind, path, steps, more):
    """Fresh model (other values) and optimizer (wrong lr), load, restore, train ``more`` steps."""
    model, opt = build(kind, full_init(123), rank, world, tp)
    for group in opt.param_groups:
        group["lr"] = 0.5  # restored from the checkpoint
    assert not opt.state  # the template is built before the first step
    sd = checkpoint_sd(model, opt)
    loaded = ldc.load(sd, path)
    for name, p in model.state_dict(keep_vars=True).items():
        assert loaded["model"][name] is p  # read in place into the parameters
    ldc.optim.restore_optimizer_state(opt, loaded["optimizer"])
    restored = copy.deepcopy(opt.state_dict())
    state = full_opt_state(model, opt)
    train(model, opt, more, steps)
    return {"params": full_params(model), "optimizer_state_dict": restored, "state": state,
            "lr": [g["lr"] for g in opt.param_groups]}


def _world2(rank, world, root, steps, more):
    """Saves under TP=2 and TP=1/DP=2, resumes under the same split and the other one."""
    out = {}
    for kind in OPTIMIZERS:
        out[("save", kind, 2)] = _train_save(rank, world, 2, kind, f"{root}/{kind}_tp2", steps, more)
        out[("save", kind, 1)] = _train_save(rank, world, 1, kind, f"{root}/{kind}_tp1dp2", steps, more)
        out[("tp2->tp2", kind)] = _resume(rank, world, 2, kind, f"{root}/{kind}_tp2", steps, more)
        out[("tp2->tp1dp2", kind)] = _resume(rank, world, 1, kind, f"{root}/{kind}_tp2", steps, more)
        out[("tp1dp2->tp1dp2", kind)] = _resume(rank, world, 1, kind, f"{root}/{kind}_tp1dp2", steps, more)
        out[("tp1dp2->tp2", kind)] = _resume(rank, world, 2, kind, f"{root}/{kind}_tp1dp2", steps, more)
    return out


def _world4(rank, world, root, steps, more):
    return {(f"tp1dp2->{name}", "adam"): _resume(rank, world, tp, "adam", f"{root}/adam_tp1dp2", steps, more)
            for name, tp in (("tp1dp4", 1), ("tp2dp2", 2))}


STEPS, MORE = 3, 2


def reference(kind):
    """The uninterrupted single-process run: full state after STEPS, params after STEPS + MORE."""
    model, opt = build(kind, full_init(0), 0, 1, 1)
    train(model, opt, STEPS, 0)
    state = full_opt_state(model, opt)
    train(model, opt, MORE, STEPS)
    return state, full_params(model)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("optim")
    per_rank = run_distributed(_world2, 2, str(root), STEPS, MORE)
    results = dict(per_rank[0])
    results.update(run_distributed(_world4, 4, str(root), STEPS, MORE)[0])
    # TP=2 -> one process without any process group.
    results[("tp2->single", "adam")] = _resume(0, 1, 1, "adam", f"{root}/adam_tp2", STEPS, MORE)
    results["ranks"] = per_rank
    return results


def assert_same(a, b, exact, what):
    assert a.keys() == b.keys(), what
    for k in a:
        if exact:
            assert torch.equal(a[k], b[k]), f"{what}: {k} differs"
        else:
            torch.testing.assert_close(a[k], b[k], rtol=1e-6, atol=1e-7, msg=lambda m, k=k: f"{what}: {k}: {m}")


def assert_state_dicts_equal(a, b, what):
    assert a["param_groups"] == b["param_groups"], what
    assert a["state"].keys() == b["state"].keys(), what
    for i in a["state"]:
        assert a["state"][i].keys() == b["state"][i].keys(), f"{what}: param {i}"
        for name in a["state"][i]:
            assert torch.equal(a["state"][i][name], b["state"][i][name]), f"{what}: param {i} state {name}"


@pytest.mark.parametrize("kind", list(OPTIMIZERS))
def test_same_split_resume_is_bit_exact_and_restores_state_dict(runs, kind):
    for split, tp in (("tp2->tp2", 2), ("tp1dp2->tp1dp2", 1)):
        resumed, saved = runs[(split, kind)], runs[("save", kind, tp)]
        assert_same(resumed["params"], saved["params"], exact=True, what=f"{kind} {split}")
        assert_state_dicts_equal(resumed["optimizer_state_dict"], saved["optimizer_state_dict"], f"{kind} {split}")
        assert resumed["lr"] == [0.05]
    # Every rank restored its own shards, not just rank 0.
    for rank, out in enumerate(runs["ranks"]):
        assert_state_dicts_equal(out[("tp2->tp2", kind)]["optimizer_state_dict"],
                                 out[("save", kind, 2)]["optimizer_state_dict"], f"{kind} rank {rank}")


@pytest.mark.parametrize("kind", list(OPTIMIZERS))
def test_tp_changes_resume_like_an_uninterrupted_run(runs, kind):
    state, params = reference(kind)
    for split, saved_tp in (("tp2->tp1dp2", 2), ("tp1dp2->tp2", 1)):
        resumed, saved = runs[(split, kind)], runs[("save", kind, saved_tp)]
        # The loaded optimizer state is exactly the saved state, resharded ...
        assert_same(resumed["state"][0], saved["state"][0], exact=True, what=f"{kind} {split} state")
        assert resumed["state"][1] == saved["state"][1]
        # ... and the run goes on like the uninterrupted one (bit-exact here; elementwise kernels
        # on other CPUs may round shards of other lengths differently, hence the tight tolerance).
        assert_same(resumed["state"][0], state[0], exact=False, what=f"{kind} {split} state vs reference")
        assert_same(resumed["params"], params, exact=False, what=f"{kind} {split} params")


def test_dp2_to_dp4_and_to_one_process(runs):
    state, params = reference("adam")
    for split, saved_tp in (("tp1dp2->tp1dp4", 1), ("tp1dp2->tp2dp2", 1), ("tp2->single", 2)):
        resumed = runs[(split, "adam")]
        assert_same(resumed["state"][0], runs[("save", "adam", saved_tp)]["state"][0], exact=True, what=split)
        assert_same(resumed["state"][0], state[0], exact=False, what=f"adam {split} state")
        assert_same(resumed["params"], params, exact=False, what=f"adam {split} params")


def test_keys_and_common_state_layout(tmp_path):
    model, opt = build("adam", full_init(0), 0, 1, 1)
    train(model, opt, 1, 0)
    sd = checkpoint_sd(model, opt)
    ldc.save(sd, tmp_path / "ck")
    meta = ldc.load_tensors_metadata(tmp_path / "ck")
    assert "optimizer.state.exp_avg.model.fc2.weight" in meta
    assert meta["optimizer.state.exp_avg_sq.model.fc1.bias"].global_shape == (HIDDEN,)
    assert not any(".step." in k for k in meta)  # scalar state is common, not sharded
    common = ldc.load_common_state_dict(tmp_path / "ck")
    assert common["optimizer"]["state"]["model.fc1.weight"]["step"] == torch.tensor(1.0)
    assert common["optimizer"]["param_groups"][0]["params"] == ["model." + k for k in TP_AXIS]
    assert common["optimizer"]["param_groups"][0]["lr"] == 0.05
    assert "param_keys" not in common["optimizer"]  # local, not saved
    st = sd["optimizer"]["state"]["model.fc1.weight"]["exp_avg"]
    assert st.data is opt.state[model.fc1.weight]["exp_avg"] and st.replica_id == (0, 0)


def test_init_optimizer_state_keeps_params_and_creates_fresh_state():
    model, opt = build("adam", full_init(0), 0, 1, 1)
    model.fc1.weight.grad = torch.ones_like(model.fc1.weight)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ldc.optim.init_optimizer_state(opt)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert torch.equal(model.fc1.weight.grad, torch.ones_like(model.fc1.weight))  # grads put back
    assert model.fc2.weight.grad is None
    for p in model.parameters():
        assert opt.state[p]["step"] == 0 and not opt.state[p]["exp_avg"].any()
    # Fresh zero state behaves exactly like no state on the next step.
    ref_model, ref_opt = build("adam", full_init(0), 0, 1, 1)
    train(model, opt, 2, 0)
    train(ref_model, ref_opt, 2, 0)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref_model.parameters()))


def test_unmappable_state_names_optimizer_and_state():
    model = ShardedMLP(full_init(0), 1, 0, 0)
    opt = torch.optim.Adafactor(model.parameters(), lr=0.01)
    with pytest.raises(ldc.CheckpointingError, match=r"state 'row_var' of optimizer Adafactor .*'model.fc1.weight'"):
        ldc.optim.optimizer_sharded_state_dict(opt, model.sharded_state_dict())


def test_parameter_missing_from_model_state_dict_is_named():
    model = ShardedMLP(full_init(0), 1, 0, 0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    msd = model.sharded_state_dict()
    del msd["fc2.weight"]
    with pytest.raises(ldc.CheckpointingError, match=r"optimizer SGD: parameter #2 .*shape \(3, 8\)"):
        ldc.optim.optimizer_sharded_state_dict(opt, msd)


def test_param_group_mismatch_is_reported(tmp_path):
    model, opt = build("adam", full_init(0), 0, 1, 1)
    ldc.save(checkpoint_sd(model, opt), tmp_path / "ck")
    other = ShardedMLP(full_init(0), 1, 0, 0)
    two_groups = torch.optim.Adam([{"params": other.fc1.parameters()}, {"params": other.fc2.parameters()}])
    loaded = ldc.load(checkpoint_sd(other, two_groups), tmp_path / "ck")
    with pytest.raises(ldc.CheckpointingError, match="checkpoint has 1 param groups, the optimizer 2"):
        ldc.optim.restore_optimizer_state(two_groups, loaded["optimizer"])


# -- allow_shape_mismatch: a vocabulary padded to another multiple ----------------------------
VOCAB, DIM = 10, 3


def padded(v, multiple):
    return -(-v // multiple) * multiple


def _vocab_save(rank, world, path):
    rows = padded(VOCAB, 8) // world  # vocab 10 padded to 16, TP=2: 8 rows each
    full = torch.zeros(padded(VOCAB, 8), DIM)
    full[:VOCAB] = torch.arange(VOCAB * DIM, dtype=torch.float32).reshape(VOCAB, DIM)
    emb = nn.Parameter(full[rank * rows:(rank + 1) * rows].clone())
    opt = torch.optim.Adam([emb], lr=0.1)
    emb.grad = torch.ones_like(emb)
    opt.step()
    msd = {"emb": ldc.ShardedTensor.from_rank_offsets("emb", emb, (0, rank, world), allow_shape_mismatch=True)}
    ldc.save({"model": msd, "optimizer": ldc.optim.optimizer_sharded_state_dict(opt, msd)}, path)
    return torch.cat([t.detach() for t in gather_list(emb.detach())]), torch.cat(
        gather_list(opt.state[emb]["exp_avg"]))


def gather_list(t):
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, t)
    return parts


def test_vocab_padded_to_another_multiple_loads_with_allow_shape_mismatch(tmp_path):
    saved_emb, saved_avg = run_distributed(_vocab_save, 2, str(tmp_path / "ck"))[0]
    for multiple in (4, 32):  # 10 -> 12 rows (truncate 16) and 10 -> 32 rows (pad 16)
        rows = padded(VOCAB, multiple)
        emb = nn.Parameter(torch.full((rows, DIM), 7.0))
        opt = torch.optim.Adam([emb], lr=0.1)
        msd = {"emb": ldc.ShardedTensor.from_rank_offsets("emb", emb, allow_shape_mismatch=True)}
        loaded = ldc.load({"model": msd, "optimizer": ldc.optim.optimizer_sharded_state_dict(opt, msd)}, tmp_path / "ck")
        ldc.optim.restore_optimizer_state(opt, loaded["optimizer"])
        keep = min(rows, 16)
        assert torch.equal(emb.detach()[:keep], saved_emb[:keep])
        assert not emb.detach()[keep:].any()  # padding beyond the saved rows is zero-filled
        assert torch.equal(opt.state[emb]["exp_avg"][:keep], saved_avg[:keep])
        assert opt.state[emb]["step"] == 1
    strict = nn.Parameter(torch.zeros(12, DIM))
    with pytest.raises(ldc.CheckpointingError, match=r"global shape \(16, 3\).*\(12, 3\)"):
        ldc.load({"emb": ldc.ShardedTensor.from_rank_offsets("emb", strict)}, tmp_path / "ck")
