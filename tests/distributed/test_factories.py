"""ShardedTensorFactory uses: fused QKV / SwiGLU gate-up kept fused per TP rank but stored as
separate tensors (so another TP size loads), a transposed storage layout, and factories applied
to optimizer state."""

import pytest
import torch
from torch import nn

import lightning_distckpt as ldc
from lightning_distckpt.core.factories import fused_split_factory, transposed_factory
from dist_utils import run_distributed

H, D, F = 4, 3, 6  # attention rows per projection, model dim, MLP rows per gate/up


def full(name, shape, scale=1.0):
    seed = sum(map(ord, name))
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale


def fused_local(parts, tp, tp_rank):
    """[p0_r; p1_r; ...]: each full part cut in tp row blocks, this rank's blocks concatenated."""
    return torch.cat([p.chunk(tp, dim=0)[tp_rank] for p in parts])


QKV = ("q", "k", "v")
GATE_UP = ("gate", "up")


class FusedBlock(nn.Module):
    """A fused QKV projection and a fused SwiGLU gate/up projection, TP-sharded by rows."""

    def __init__(self, tp, tp_rank, seed_suffix=""):
        super().__init__()
        self.tp, self.tp_rank = tp, tp_rank
        self.qkv = nn.Parameter(fused_local([full(n + seed_suffix, (H, D)) for n in QKV], tp, tp_rank))
        self.gate_up = nn.Parameter(fused_local([full(n + seed_suffix, (F, D)) for n in GATE_UP], tp, tp_rank))

    def sharded_state_dict(self):
        sd = self.state_dict(keep_vars=True)
        tp_off = (0, self.tp_rank, self.tp)
        return {
            "qkv": fused_split_factory("block.qkv", sd["qkv"], [(n, H // self.tp) for n in QKV], tp_off),
            "gate_up": fused_split_factory("block.gate_up", sd["gate_up"], [(n, F // self.tp) for n in GATE_UP],
                                               tp_off),
        }


def adam_after_one_step(block):
    """One Adam step with a gradient derived from the full (TP-independent) gradient."""
    opt = torch.optim.Adam(block.parameters(), lr=0.1)
    block.qkv.grad = fused_local([full("g" + n, (H, D)) for n in QKV], block.tp, block.tp_rank)
    block.gate_up.grad = fused_local([full("g" + n, (F, D)) for n in GATE_UP], block.tp, block.tp_rank)
    opt.step()
    return opt


def state_for(block, opt):
    msd = block.sharded_state_dict()
    return {"model": msd, "optimizer": ldc.optim.optimizer_sharded_state_dict(opt, msd)}


def _save_tp2(rank, world, path):
    block = FusedBlock(world, rank)
    ldc.save(state_for(block, adam_after_one_step(block)), path)


def saved_parts(block, opt):
    """{(tensor, part name): full part} from a TP=1 block: what a TP=1 save stores."""
    out = {}
    for name, names, rows in (("qkv", QKV, H), ("gate_up", GATE_UP, F)):
        p = getattr(block, name)
        for what, t in (("param", p.detach()), ("exp_avg", opt.state[p]["exp_avg"]),
                        ("exp_avg_sq", opt.state[p]["exp_avg_sq"])):
            for i, n in enumerate(names):
                out[(name, what, n)] = t[i * rows:(i + 1) * rows].clone()
    return out


def check_loaded(block, opt, parts, step, what):
    """Exact: each fused tensor (and its Adam state) is this rank's rows of the saved parts."""
    for name, names in (("qkv", QKV), ("gate_up", GATE_UP)):
        p = getattr(block, name)
        for kind, t in (("param", p.detach()), ("exp_avg", opt.state[p]["exp_avg"]),
                        ("exp_avg_sq", opt.state[p]["exp_avg_sq"])):
            want = fused_local([parts[(name, kind, n)] for n in names], block.tp, block.tp_rank)
            assert torch.equal(t, want), f"{what}: {name} {kind}"
        assert opt.state[p]["step"] == step
        assert opt.param_groups[0]["lr"] == 0.1


def _load_tp2(rank, world, path, parts):
    block = FusedBlock(world, rank, seed_suffix="other")
    opt = torch.optim.Adam(block.parameters(), lr=0.7)
    loaded = ldc.load(state_for(block, opt), path)
    block.load_state_dict(loaded["model"])
    ldc.optim.restore_optimizer_state(opt, loaded["optimizer"])
    check_loaded(block, opt, parts, 1, f"TP1 -> TP2 rank {rank}")
    return True


def test_fused_qkv_and_gate_up_saved_tp2_load_tp1_with_optimizer_state(tmp_path):
    path = tmp_path / "tp2"
    run_distributed(_save_tp2, 2, str(path))
    # The checkpoint holds the separate, full projections, whatever TP wrote them; the factory
    # applies to the optimizer state too.
    plain = ldc.load_plain_tensors(path)
    assert "block.qkv" not in plain
    parts = {(name, kind, n): plain[key + f"block.{name}.{n}"]
             for name, names in (("qkv", QKV), ("gate_up", GATE_UP)) for n in names
             for kind, key in (("param", ""), ("exp_avg", "optimizer.state.exp_avg."),
                               ("exp_avg_sq", "optimizer.state.exp_avg_sq."))}
    # The parts are what one process computes on the whole tensors (up to kernel rounding).
    ref = FusedBlock(1, 0)
    ref_parts = saved_parts(ref, adam_after_one_step(ref))
    for k, t in ref_parts.items():
        torch.testing.assert_close(parts[k], t, rtol=1e-6, atol=1e-7)
    block = FusedBlock(1, 0, seed_suffix="other")
    opt = torch.optim.Adam(block.parameters(), lr=0.7)
    loaded = ldc.load(state_for(block, opt), path)
    assert torch.equal(loaded["model"]["qkv"], torch.cat([parts[("qkv", "param", n)] for n in QKV]))
    block.load_state_dict(loaded["model"])
    ldc.optim.restore_optimizer_state(opt, loaded["optimizer"])
    check_loaded(block, opt, parts, 1, "TP2 -> TP1")


def test_fused_saved_tp1_load_tp2(tmp_path):
    path = tmp_path / "tp1"
    block = FusedBlock(1, 0)
    opt = adam_after_one_step(block)
    ldc.save(state_for(block, opt), path)
    assert all(run_distributed(_load_tp2, 2, str(path), saved_parts(block, opt)))


def test_grouped_interleave_changes_tp(tmp_path):
    """Megatron-style GQA layout: per query group [q_g; k_g; v_g] rows. Saved by two TP ranks
    (one group each, simulated in one process), read by one rank holding both groups."""
    groups, qg, kvg = 2, 2, 1  # rows per group: 2 q rows, 1 k row, 1 v row
    q, k, v = full("q", (groups * qg, D)), full("k", (groups * kvg, D)), full("v", (groups * kvg, D))

    def layout(gs):  # fused rows for the query groups gs
        return torch.cat([torch.cat([q[g * qg:(g + 1) * qg], k[g:g + 1], v[g:g + 1]]) for g in gs])

    parts = [("q", qg), ("k", kvg), ("v", kvg)]
    sd = {f"rank{r}": fused_split_factory("qkv", layout([r]), parts, (0, r, 2)) for r in range(2)}
    ldc.save(sd, tmp_path / "ck")
    plain = ldc.load_plain_tensors(tmp_path / "ck")
    assert torch.equal(plain["qkv.q"], q) and torch.equal(plain["qkv.k"], k) and torch.equal(plain["qkv.v"], v)
    target = torch.zeros(groups * (qg + 2 * kvg), D)
    loaded = ldc.load({"qkv": fused_split_factory("qkv", target, parts, groups=groups)}, tmp_path / "ck")
    assert torch.equal(loaded["qkv"], layout(range(groups)))


def test_transposed_storage_layout(tmp_path):
    """A Conv1D-style weight (in, out) kept transposed, stored as a Linear weight (out, in) sharded
    by output rows; read back whole as a plain tensor and, through the factory, in place."""
    w = full("conv1d", (D, 2 * H))  # (in, out)
    sd = {f"rank{r}": transposed_factory("proj.weight", w[:, r * H:(r + 1) * H].clone(), (0, r, 2))
          for r in range(2)}
    ldc.save(sd, tmp_path / "ck")
    stored = ldc.load_plain_tensors(tmp_path / "ck")["proj.weight"]
    assert torch.equal(stored, w.T)
    linear = ldc.load({"w": ldc.ShardedTensor.from_rank_offsets("proj.weight", torch.zeros(2 * H, D))}, tmp_path / "ck")
    assert torch.equal(linear["w"], w.T)
    param = nn.Parameter(torch.zeros(D, 2 * H))
    loaded = ldc.load({"w": transposed_factory("proj.weight", param)}, tmp_path / "ck")
    assert torch.equal(param.detach(), w)  # read in place through the transposed view
    assert torch.equal(loaded["w"], w)


def test_factory_errors_are_clear():
    with pytest.raises(ldc.ShardingError, match=r"'qkv': local size 5 along axis 0 is not 1 x \[2, 2\] = 4"):
        fused_split_factory("qkv", torch.zeros(5, 2), [("a", 2), ("b", 2)]).build()
    flat = ldc.ShardedTensorFactory("x", torch.zeros(4, 2), fused_split_factory(
        "x", torch.zeros(4, 2), [("a", 2), ("b", 2)]).build_fn, lambda t: t, flattened_range=slice(0, 3))
    with pytest.raises(ldc.ShardingError, match="cannot be applied to flattened data"):
        flat.build()
    with pytest.raises(ldc.ShardingError, match="distinct names"):
        fused_split_factory("x", torch.zeros(4, 2), [("a", 2), ("a", 2)])
    with pytest.raises(ldc.ShardingError, match="two distinct axes"):
        transposed_factory("x", torch.zeros(4))
