"""Ready-made ShardedTensorFactories: a local tensor stored in another layout than it is kept.

* :func:`fused_split_factory` - a fused weight (attention QKV, SwiGLU gate/up) stored as
  separate checkpoint tensors, so the checkpoint does not depend on how the parts were
  interleaved per tensor-parallel rank and loads under another TP size.
* :func:`transposed_factory` - a tensor kept transposed (e.g. GPT-2's ``Conv1D``) stored in the
  other orientation, so it reads as a plain ``nn.Linear`` weight.

Both work for parameters and, through ``optimizer_sharded_state_dict``, for their optimizer
state (the factory is re-applied with the state tensor as ``data``).
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Sequence, Tuple

import torch

from .errors import ShardingError
from .mapping import ReplicaId, ShardedTensor, ShardedTensorFactory


def _no_flat(key: str, flattened_range: Optional[slice], what: str) -> None:
    if flattened_range is not None:
        raise ShardingError(
            f"{key!r}: {what} needs the whole local tensor; it cannot be applied to flattened data "
            f"(flattened_range={flattened_range.start}:{flattened_range.stop})"
        )


def fused_split_factory(
    key: str,
    data: torch.Tensor,
    parts: Sequence[Tuple[str, int]],
    *rank_offsets: Tuple[int, int, int],
    axis: int = 0,
    groups: int = 1,
    replica_id: ReplicaId = 0,
    prepend_axis_num: int = 0,
    allow_shape_mismatch: bool = False,
) -> ShardedTensorFactory:
    """Store a fused local tensor as one checkpoint tensor per part: ``<key>.<name>``.

    Along local axis ``axis`` the fused tensor holds ``groups`` repetitions of the parts, in
    order: ``[p0, p1, ...] * groups`` with part ``name`` being ``size`` long each time (``groups=1``:
    plain ``torch.cat`` of the parts, e.g. ``[q; k; v]`` or ``[gate; up]``; ``groups > 1``: e.g.
    Megatron's per-query-group ``[q_g, k_g, v_g]`` interleaving). Each part, its groups
    concatenated, is sharded with ``rank_offsets`` like :meth:`ShardedTensor.from_rank_offsets`:
    ``(0, tp_rank, tp_size)`` stacks the TP ranks' parts, so the stored ``<key>.q`` is the full Q
    weight whatever the TP size, and a different TP size reads the rows it needs.

    On load the parts are read and re-fused with the same layout (a new tensor). ``key``: the prefix of
    the parts' keys; ``data``: the fused local tensor; ``replica_id``, ``prepend_axis_num`` and
    ``allow_shape_mismatch``: as :class:`ShardedTensor`'s. Distinct names, positive sizes, ``groups`` >= 1
    and an ``axis`` of ``data`` are required, else a ShardingError.
    """
    names = [n for n, _ in parts]
    sizes = [int(s) for _, s in parts]
    if len(set(names)) != len(names) or any(s < 1 for s in sizes) or groups < 1:
        raise ShardingError(f"{key!r}: fused parts need distinct names and positive sizes, got {list(parts)}")
    if not -data.dim() <= axis < data.dim():
        raise ShardingError(f"{key!r}: axis {axis} out of range for a {data.dim()}-D tensor")
    ax = axis % data.dim()
    fused = groups * sum(sizes)

    def build(k: str, t: torch.Tensor, rid: ReplicaId, flattened_range: Optional[slice]) -> Dict[str, Any]:
        _no_flat(k, flattened_range, "fused_split_factory")
        if t.shape[ax] != fused:
            raise ShardingError(
                f"{k!r}: local size {t.shape[ax]} along axis {ax} is not {groups} x {sizes} = {fused}"
            )
        t = t.detach()
        # (.., groups, sum(sizes), ..) -> split the parts -> each back to (.., groups * size, ..)
        grouped = t.unflatten(ax, (groups, sum(sizes)))
        out = {}
        for name, chunk in zip(names, torch.split(grouped, sizes, dim=ax + 1)):
            part = chunk.flatten(ax, ax + 1)  # a view when groups == 1: loads land in `t` itself
            out[name] = ShardedTensor.from_rank_offsets(
                f"{k}.{name}", part, *rank_offsets, replica_id=rid, prepend_axis_num=prepend_axis_num,
                allow_shape_mismatch=allow_shape_mismatch,
            )
        return out

    def merge(loaded: Dict[str, torch.Tensor]) -> torch.Tensor:
        chunks = [loaded[name].unflatten(ax, (groups, size)) for name, size in zip(names, sizes)]
        return torch.cat(chunks, dim=ax + 1).flatten(ax, ax + 1)

    return ShardedTensorFactory(key, data, build, merge, replica_id=replica_id)


def transposed_factory(
    key: str,
    data: torch.Tensor,
    *rank_offsets: Tuple[int, int, int],
    dims: Tuple[int, int] = (0, 1),
    replica_id: ReplicaId = 0,
    prepend_axis_num: int = 0,
) -> ShardedTensorFactory:
    """Store ``data.transpose(*dims)`` under ``key``; ``rank_offsets`` describe the stored
    (transposed) layout. On load the stored tensor is read into ``data`` in place (through the
    transposed view) and returned in ``data``'s orientation. ``dims``: two distinct axes of ``data`` (at
    least 2-D), else a ShardingError; ``replica_id`` and ``prepend_axis_num``: as :class:`ShardedTensor`'s."""
    if data.dim() < 2 or len(set(d % data.dim() for d in dims)) != 2:
        raise ShardingError(f"{key!r}: transposed_factory needs two distinct axes of a >= 2-D tensor, got {dims}")

    def build(k: str, t: torch.Tensor, rid: ReplicaId, flattened_range: Optional[slice]) -> ShardedTensor:
        _no_flat(k, flattened_range, "transposed_factory")
        return ShardedTensor.from_rank_offsets(
            k, t.detach().transpose(*dims), *rank_offsets, replica_id=rid, prepend_axis_num=prepend_axis_num
        )

    def merge(loaded: torch.Tensor) -> torch.Tensor:
        return loaded.transpose(*dims)

    return ShardedTensorFactory(key, data, build, merge, replica_id=replica_id)

