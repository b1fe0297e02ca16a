"""ParallelState and the tensor-parallel layers in one process. On 2 real gloo processes (TP 2 gives
the same outputs and gradients as the un-sharded layers; the groups; the sharded state dict): the
"tp_layers" scenario run by test_lightning_strategy.py in the processes Lightning launched."""

import pytest
import torch

from lightning_distckpt.core.errors import ArgumentError
from lightning_distckpt.lightning.parallel import ParallelState, module_sharded_state_dict, parallel_state_of
from example_layers import ColumnParallelLinear, RowParallelLinear  # examples/tp_layers.py


def test_single_process_state_and_errors():
    ps = ParallelState.single()
    assert (ps.tp_size, ps.dp_size, ps.tp_group, ps.dp_group) == (1, 1, None, None)
    assert parallel_state_of(torch.nn.Linear(2, 2)) == ps  # no trainer, no process group: one process
    with pytest.raises(ArgumentError, match="needs torch.distributed"):
        ParallelState.build(tensor_parallel_size=2)
    with pytest.raises(ArgumentError, match="out_features=6 is not divisible"):
        ColumnParallelLinear(4, 6, ParallelState(world_size=4, rank=0, tp_size=4, tp_rank=0, dp_size=1, dp_rank=0))


def test_layers_initialize_like_nn_linear_and_describe_whole_tensors():
    ps = ParallelState.single()
    torch.manual_seed(3)
    col, row = ColumnParallelLinear(6, 8, ps), RowParallelLinear(8, 3, ps)
    torch.manual_seed(3)
    ref1, ref2 = torch.nn.Linear(6, 8), torch.nn.Linear(8, 3)
    for mine, ref in ((col, ref1), (row, ref2)):
        assert torch.equal(mine.weight, ref.weight) and torch.equal(mine.bias, ref.bias)
    x = torch.randn(4, 6)
    assert torch.allclose(row(col(x)), ref2(ref1(x)))
    sd = module_sharded_state_dict(torch.nn.ModuleDict({"a": col, "b": row}), "net.", replica_id=ps.replicated_id)
    assert sorted(sd) == ["net.a.bias", "net.a.weight", "net.b.bias", "net.b.weight"]
    assert sd["net.a.weight"].data is col.weight and sd["net.a.weight"].global_shape == (8, 6)
    assert sd["net.b.weight"].global_shape == (3, 8) and sd["net.b.bias"].replica_id == (0, 0)
