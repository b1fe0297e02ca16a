"""DistModule: a tensor-parallel module built on the meta device loads a whole state dict held by
rank 0; every rank gets its shards, the forward pass matches the unsharded model."""

import pytest
import torch
from torch import nn

from dist_utils import run_distributed
from lightning_distckpt.core.errors import MissingKeysError
from lightning_distckpt.ingest import DistModule, load_state_dict
from example_layers import ColumnParallelLinear, RowParallelLinear  # examples/tp_layers.py


class Block(nn.Module):
    """Column- then row-parallel linear, a LayerNorm and a buffer: no sharded_state_dict of its own,
    so the TP layers describe their shards and the rest is loaded whole on every rank."""

    def __init__(self, ps):
        super().__init__()
        self.up = ColumnParallelLinear(8, 16, ps)
        self.down = RowParallelLinear(16, 8, ps)
        self.norm = nn.LayerNorm(8)
        self.register_buffer("scale", torch.tensor(2.0))

    def forward(self, x):
        return self.norm(self.down(torch.relu(self.up(x)))) * self.scale


def _ps(rank, world):
    from lightning_distckpt.lightning.parallel import ParallelState

    return ParallelState(world_size=world, rank=rank, tp_size=world, tp_rank=rank, dp_size=1, dp_rank=0)


def _full_model():
    from lightning_distckpt.lightning.parallel import ParallelState

    torch.manual_seed(0)
    model = Block(ParallelState.single())
    with torch.no_grad():
        model.norm.weight.uniform_(0.5, 1.5)
        model.norm.bias.uniform_(-0.5, 0.5)
        model.scale.fill_(3.0)
    return model


def _meta_model(rank, world):
    with torch.device("meta"):
        return DistModule(Block(_ps(rank, world)))


def _load_and_run(rank, world, path):
    full = {k: v.clone() for k, v in torch.load(path, weights_only=True).items()}
    dm = _meta_model(rank, world)
    result = dm.load_state_dict(load_state_dict(path), assign=True)
    assert result.missing_keys == [] and result.unexpected_keys == []
    assert torch.equal(dm.up.weight, full["up.weight"].chunk(world, 0)[rank])  # attribute access delegated
    assert torch.equal(dm.up.bias, full["up.bias"].chunk(world, 0)[rank])
    assert torch.equal(dm.down.weight, full["down.weight"].chunk(world, 1)[rank])
    for key in ("down.bias", "norm.weight", "norm.bias", "scale"):
        assert torch.equal(dm.state_dict()[key], full[key]), key
    assert isinstance(dm.up.weight, nn.Parameter) and dm.up.weight.device.type == "cpu"
    dm.tag = "set through the wrapper"
    assert dm.module.tag == "set through the wrapper"
    reference = _full_model()
    reference.load_state_dict(full)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(dm(x), reference(x), rtol=1e-5, atol=1e-6)
    return sorted(dm.state_dict())


def _strictness(rank, world, extra_path, short_path):
    out = {}
    with pytest.raises(MissingKeysError, match="extra"):
        _meta_model(rank, world).load_state_dict(load_state_dict(extra_path), assign=True)
    res = _meta_model(rank, world).load_state_dict(load_state_dict(extra_path), strict=False, assign=True)
    out["unexpected"] = list(res.unexpected_keys)
    with pytest.raises(MissingKeysError, match="norm.bias"):
        _meta_model(rank, world).load_state_dict(load_state_dict(short_path), assign=True)
    res = _meta_model(rank, world).load_state_dict(load_state_dict(short_path), strict=False, assign=True)
    out["missing"] = list(res.missing_keys)
    return out


@pytest.fixture(scope="module")
def block_file(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("distmodule") / "block.pt")
    torch.save(_full_model().state_dict(), path)
    return path


def test_single_process(block_file):
    assert "up.weight" in _load_and_run(0, 1, block_file)


def test_two_processes(block_file):
    keys = run_distributed(_load_and_run, 2, block_file)
    assert keys[0] == keys[1]


def test_strict_keys_on_every_rank(block_file, tmp_path):
    full = torch.load(block_file, weights_only=True)
    extra, short = str(tmp_path / "extra.pt"), str(tmp_path / "short.pt")
    torch.save({**full, "extra.weight": torch.ones(3)}, extra)
    torch.save({k: v for k, v in full.items() if k != "norm.bias"}, short)
    per_rank = run_distributed(_strictness, 2, extra, short)
    assert per_rank[0] == per_rank[1] == {"unexpected": ["extra.weight"], "missing": ["norm.bias"]}


def test_wrapper_delegates():
    import copy
    import pickle

    dm = DistModule(nn.Linear(2, 3))
    assert dm.in_features == 2 and list(dm.state_dict()) == ["weight", "bias"]
    dm.eval()
    assert not dm.module.training
    dm.note = 1
    assert dm.module.note == 1 and "note" not in dm.__dict__
    for clone in (copy.deepcopy(dm), pickle.loads(pickle.dumps(dm))):
        assert clone.out_features == 3 and torch.equal(clone(torch.ones(1, 2)), dm(torch.ones(1, 2)))
