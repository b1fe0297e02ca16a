"""Building the sharded state dicts of a model and its optimizers (shared by the Trainer and the
Fabric strategies)."""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Sequence, TypeVar

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from ..comm import Comm, get_comm
from ..core.errors import CheckpointingError
from ..core.mapping import ShardedTensor, ShardedTensorFactory, is_main_replica
from ..core.megatron_leaves import from_megatron_leaves
from ..core.state_dict import iter_leaves
from ..reading.checkpoint import CheckpointSource
from .parallel import ParallelState, module_sharded_state_dict
from .stock import SavedCheckpoint, describe_common


def model_sharded_state_dict(module: nn.Module, ps: ParallelState, prefix: str = "") -> Dict[str, Any]:
    """``module.sharded_state_dict(prefix=prefix)`` when the module defines it; otherwise
    :func:`module_sharded_state_dict`: submodules that define one describe their shards, every other
    tensor is a whole tensor replicated on all ranks."""
    fn = getattr(module, "sharded_state_dict", None)
    if callable(fn):
        out = fn(prefix=prefix)
        if not isinstance(out, dict):
            raise CheckpointingError(
                f"{type(module).__name__}.sharded_state_dict() must return a dict, got {type(out).__name__}"
            )
        # A Megatron-Core model's sharded_state_dict() is used as it is: its leaves become ours
        # here, so the optimizer helpers find each parameter's ShardedTensor.
        out = from_megatron_leaves(out)
    else:
        check_describable(module, ps)
        out = module_sharded_state_dict(module, prefix, replica_id=ps.replicated_id)
    _refuse_dtensor_parameters(module, out)
    return out


def _refuse_dtensor_parameters(module: nn.Module, ssd: Dict[str, Any]) -> None:
    """A ShardedTensor wrapping a DTensor would describe the DTensor's global shape as this rank's
    shard. DTensor parameters come from ``fully_shard`` / ``parallelize_module``, which these
    DDP-based strategies do not run: say which strategy does."""
    for _, leaf in iter_leaves(ssd):
        if isinstance(leaf, ShardedTensor) and isinstance(leaf.data, DTensor):
            raise CheckpointingError(
                f"{type(module).__name__}: {leaf.key!r} is a DTensor parameter (placements "
                f"{tuple(leaf.data.placements)}); DistCheckpointStrategy / FabricDistCheckpointStrategy wrap the "
                "module in DDP over their own TP x DP groups. Train FSDP2 / torch tensor-parallel modules with "
                "DistCheckpointModelParallelStrategy (Trainer) instead"
            )


def all_whole(ssd: Dict[str, Any]) -> bool:
    """Whether every tensor of a module's sharded state dict is held whole by this rank (TP 1, DP only)."""
    leaves = [leaf for _, leaf in iter_leaves(ssd) if isinstance(leaf, (ShardedTensor, ShardedTensorFactory))]
    return all(isinstance(leaf, ShardedTensor) and leaf.flattened_range is None
               and leaf.local_shape == leaf.global_shape for leaf in leaves)


def replicated_state_dict(given: Dict[str, Any], ps: ParallelState) -> Dict[str, Any]:
    """A plain state dict (whole tensors, as every rank holds them) described for a save: each tensor
    replicated, written once (``replica_id``); other values common state."""
    return {key: ShardedTensor.from_rank_offsets(key, value.detach(), replica_id=ps.replicated_id)
            if isinstance(value, torch.Tensor) else value for key, value in given.items()}


def main_replicas_of_buffers(ssd: Dict[str, Any], parameters: Sequence[torch.Tensor]) -> Dict[str, Any]:
    """``ssd`` (a module's flat sharded state dict) without this rank's non-main replicas of tensors other
    than ``parameters``. DDP keeps the parameters equal on every DP rank, not the buffers: a buffer updated
    in the forward (BatchNorm's running statistics) differs by rank, and stock DDP saves rank 0's. Left
    in, a balanced save picks any holder's copy (rank 1's), so a resume diverged from stock's."""
    kept = {id(p) for p in parameters}
    return {k: v for k, v in ssd.items()
            if not isinstance(v, ShardedTensor) or id(v.data) in kept or is_main_replica(v.replica_id)}


def check_describable(module: nn.Module, ps: ParallelState) -> None:
    """Under tensor parallelism, something in the module tree must describe its shards: otherwise
    every tensor would be saved as a replica, one TP rank's shard as the whole tensor. Refuse."""
    if ps.tp_size > 1 and not any(callable(getattr(m, "sharded_state_dict", None)) for m in module.modules()):
        raise CheckpointingError(
            f"{type(module).__name__} and its submodules define no sharded_state_dict(prefix=''), so its tensors "
            f"cannot be described under tensor_parallel_size={ps.tp_size}; define it on the layers that hold "
            f"a piece: a ShardedTensor per parameter saying where it sits (docs/lightning.md, \"The module's side\")"
        )


def optimizer_sharded_state(optimizer: Optimizer, model_ssd: Dict[str, Any], prefix: str,
                            init_state: bool) -> Dict[str, Any]:
    """The optimizer helpers' sharded optimizer state (imported here: they are optional machinery)."""
    from ..optim import optimizer_sharded_state_dict

    return optimizer_sharded_state_dict(optimizer, model_ssd, prefix=prefix, init_state=init_state)


def restore_optimizer(optimizer: Optimizer, loaded: Dict[str, Any]) -> None:
    from ..optim import restore_optimizer_state

    restore_optimizer_state(optimizer, loaded)


def restore_optimizers_agreed(what: str, optimizers: Sequence[Optimizer], states: Sequence[Dict[str, Any]]) -> None:
    """Collective: each loaded state into its optimizer (:func:`restore_optimizer`), the outcome agreed:
    a state one rank cannot take (a factory's ``merge_fn`` giving it a wrong value) fails every rank here,
    instead of that rank alone while the others train on into their next collective."""
    def restore() -> None:
        for opt, state in zip(optimizers, states):
            restore_optimizer(opt, state)

    build_on_all_ranks(what, restore, failed=AFTER_READING)


def describe_source(source: CheckpointSource, extra_safe_globals: Sequence[Any] = ()) -> SavedCheckpoint:
    """Kind, manifest and top-level entries of an opened checkpoint, from its common state (as
    :func:`~lightning_distckpt.lightning.stock.describe_saved` of its path, without opening it again)."""
    return describe_common(source.load_common(extra_safe_globals))


T = TypeVar("T")
AFTER_READING = "failed after reading"  # build_on_all_ranks's words for a restore after a collective load


class AlreadyAgreed(Exception):
    """Raised inside a :func:`build_on_all_ranks` block by a step that agreed its outcome over the group itself
    (a ``load_state_dict`` hook reading moved weights, :mod:`.unused_weights`): every rank raises ``error``
    there, or in the agreement it met instead, so no further agreement is made (none would be matched)."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


def build_on_all_ranks(what: str, build: Callable[[], T], comm: Optional[Comm] = None, *,
                       failed: str = "failed before any I/O") -> T:
    """Run ``build`` (local work before a collective save/load, or after a load: the loaded values put
    into the module, the optimizers, the user's objects) and agree on its outcome over the group
    (:meth:`Comm.agree`): if it failed on any rank, every rank raises the same error naming the failing
    ranks (``"<what> <failed>: rank r: ..."``), so no rank is left waiting in a collective the others
    never enter, nor goes on alone past a restore another rank could not make."""
    comm = comm or get_comm()
    result: Optional[T] = None
    error: Optional[Exception] = None
    try:
        result = build()
    except AlreadyAgreed as e:  # every rank raises it already: none waits in the agreement below
        raise e.error from None
    except Exception as e:  # reported collectively below
        error = e
    comm.agree(f"{what} {failed}", error)
    return result  # type: ignore[return-value]


def tree_or_failing(build: Callable[[], Dict[str, Any]]) -> Dict[str, Any]:
    """``build()``, or where it raises, :func:`failing_tree` of its error: for a tree built locally
    before a collective save, whose handshake then agrees on the failure."""
    try:
        return build()
    except Exception as e:  # agreed by the save's handshake, not by a collective of its own
        return failing_tree(e)


def failing_tree(error: Exception) -> Dict[str, Any]:
    """A state dict whose description raises ``error``: its one entry is a factory that re-raises it.
    The save's handshake agrees on every rank's failure to describe its state
    (``saving/save_prepare.prepare_save``), so every rank raises ``error`` (its type kept, this rank
    named) before anything is written, as it would for a failure inside ``sharded_state_dict``: one
    collective round fewer than :func:`build_on_all_ranks` before the save."""
    def fail(*_: Any) -> Any:
        raise error

    return {"failed": ShardedTensorFactory("failed", torch.empty(0), fail, fail)}
