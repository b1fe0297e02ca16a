"""Megatron-style tensor-parallel linear layers for the examples (and the tests): a sketch of what a
tensor-parallel library's layers hand to lightning_distckpt, not part of the package.

:class:`ColumnParallelLinear` splits the output features over the tensor-parallel group,
:class:`RowParallelLinear` the input features. What makes a model built from them checkpoint and
reshard between TP sizes is the contract any layer can follow: ``sharded_state_dict(prefix)``
returns a :class:`~lightning_distckpt.ShardedTensor` per parameter saying where this rank's piece
sits in the global tensor (``from_rank_offsets(key, piece, (axis, tp_rank, tp_size),
replica_id=dp_rank)``). For real models use a tensor-parallel library's layers (Megatron-Core, ...)
under ``DistCheckpointStrategy``, or torch's own tensor parallel (``parallelize_module``) under
``DistCheckpointModelParallelStrategy``.

The examples import this file from their own directory (``python examples/NAME.py`` puts it on
``sys.path``); copy it beside your script to use it.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Dict, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from lightning_distckpt import ArgumentError, ShardedTensor  # ArgumentError: a ValueError

if TYPE_CHECKING:  # only its attributes are used: no Lightning import for these layers
    from lightning_distckpt.lightning import ParallelState

__all__ = ["ColumnParallelLinear", "RowParallelLinear"]


# -- Megatron's "f" and "g": identity one way, all-reduce over the TP group the other ---------------
class _CopyToTensorParallel(torch.autograd.Function):
    """Forward: identity. Backward: sum the input gradient over the TP group (each TP rank used the
    same input for its own slice of the output)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[torch.Tensor, None]:
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTensorParallel(torch.autograd.Function):
    """Forward: sum the partial outputs over the TP group. Backward: identity (every TP rank gets
    the same output gradient)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
        x = x.contiguous()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[torch.Tensor, None]:
        return grad, None


class _TensorParallelLinear(nn.Module):
    """``y = x W^T + b`` with ``W`` split over the TP group along ``split_dim`` (0: output features,
    1: input features). Every rank draws the whole weight with ``nn.Linear``'s default init from the
    same RNG state and keeps its slice, so a model is the same whatever its TP size."""

    def __init__(self, in_features: int, out_features: int, ps: ParallelState, bias: bool, split_dim: int) -> None:
        super().__init__()
        split = (out_features, in_features)[split_dim]
        if split % ps.tp_size:
            name = ("out_features", "in_features")[split_dim]
            raise ArgumentError(f"{type(self).__name__}: {name}={split} is not divisible by "
                                f"tensor_parallel_size={ps.tp_size}")
        self.ps, self.split_dim = ps, split_dim
        self.in_features, self.out_features = in_features, out_features
        part = split // ps.tp_size
        own = slice(ps.tp_rank * part, (ps.tp_rank + 1) * part)
        weight = torch.empty(out_features, in_features)
        nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
        self.weight = nn.Parameter((weight[own] if split_dim == 0 else weight[:, own]).clone())
        self.bias: Optional[nn.Parameter] = None
        if bias:
            bound = 1 / math.sqrt(in_features) if in_features > 0 else 0
            full_bias = torch.empty(out_features).uniform_(-bound, bound)
            # A row-parallel layer adds its bias after the reduction: every TP rank holds it whole.
            self.bias = nn.Parameter(full_bias[own].clone() if split_dim == 0 else full_bias)

    def sharded_state_dict(self, prefix: str = "") -> Dict[str, ShardedTensor]:
        """The weight sharded along ``split_dim``; the bias sharded like the output features or replicated."""
        ps = self.ps
        out = {f"{prefix}weight": ShardedTensor.from_rank_offsets(
            f"{prefix}weight", self.weight, (self.split_dim, ps.tp_rank, ps.tp_size), replica_id=ps.dp_rank)}
        if self.bias is not None and self.split_dim == 0:
            out[f"{prefix}bias"] = ShardedTensor.from_rank_offsets(
                f"{prefix}bias", self.bias, (0, ps.tp_rank, ps.tp_size), replica_id=ps.dp_rank)
        elif self.bias is not None:
            out[f"{prefix}bias"] = ShardedTensor.from_rank_offsets(
                f"{prefix}bias", self.bias, replica_id=ps.replicated_id)
        return out


class ColumnParallelLinear(_TensorParallelLinear):
    """``y = x W^T + b`` with the output features of ``W`` (and ``b``) split over the TP group.

    The output is this rank's slice of the features (feed it to a :class:`RowParallelLinear`).
    """

    def __init__(self, in_features: int, out_features: int, ps: ParallelState, bias: bool = True) -> None:
        super().__init__(in_features, out_features, ps, bias, split_dim=0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ps.tp_size > 1:
            x = _CopyToTensorParallel.apply(x, self.ps.tp_group)
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(_TensorParallelLinear):
    """``y = x W^T + b`` with the input features of ``W`` split over the TP group; takes this rank's
    slice of the input features (a :class:`ColumnParallelLinear`'s output) and returns the full,
    all-reduced output. The bias is replicated and added after the reduction."""

    def __init__(self, in_features: int, out_features: int, ps: ParallelState, bias: bool = True) -> None:
        super().__init__(in_features, out_features, ps, bias, split_dim=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        if self.ps.tp_size > 1:
            y = _ReduceFromTensorParallel.apply(y, self.ps.tp_group)
        return y + self.bias if self.bias is not None else y
