"""Tensor-parallel x data-parallel process groups, and sharded state dicts of plain modules.

Rank layout (Megatron's): tensor-parallel ranks are contiguous. With ``tp`` tensor-parallel ranks,
global rank ``r`` has ``tp_rank = r % tp`` and ``dp_rank = r // tp``; the TP group of ``r`` holds
the ``tp`` ranks of one model replica, its DP group the ranks holding the same shard in every replica.
(How a tensor-parallel layer describes its pieces: docs/lightning.md, "The module's side".)
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from ..core.errors import ArgumentError, ArgumentTypeError
from ..core.mapping import ReplicaId, ShardedTensor
from ..registration import is_placeholder


@dataclass(frozen=True)
class ParallelState:
    """This process's place in a TP x DP grid, with the process groups to talk to its peers.

    Attributes:
        world_size: the number of processes, ``tp_size * dp_size``.
        rank: this process's global rank.
        tp_size: tensor-parallel ranks per model replica.
        tp_rank: this rank's place among them.
        dp_size: model replicas (data-parallel ranks).
        dp_rank: this rank's replica.
        tp_group: the ranks holding the other shards of this replica (``None`` in one process).
        dp_group: the ranks holding the same shards (``None`` in one process).
    """

    world_size: int
    rank: int
    tp_size: int
    tp_rank: int
    dp_size: int
    dp_rank: int
    tp_group: Optional[dist.ProcessGroup] = None
    dp_group: Optional[dist.ProcessGroup] = None

    # A ParallelState is kept by the strategy and by modules built with it (self.ps), and so travels
    # with them when a Trainer is pickled (torch.save(trainer)) or copied (deepcopy of callbacks that
    # hold the trainer). Process groups are handles of this process: a copy is this very object
    # (immutable), a pickle carries the layout and finds the groups again where they still live.
    def __deepcopy__(self, memo: Dict[int, Any]) -> "ParallelState":
        return self

    def __reduce__(self) -> Tuple[Any, Tuple[int, ...]]:
        return _rebuild, (self.world_size, self.rank, self.tp_size, self.tp_rank, self.dp_size, self.dp_rank)

    @classmethod
    def single(cls) -> "ParallelState":
        """One process: TP 1 x DP 1, no groups."""
        return cls(world_size=1, rank=0, tp_size=1, tp_rank=0, dp_size=1, dp_rank=0)

    @classmethod
    def build(cls, tensor_parallel_size: int = 1) -> "ParallelState":
        """Create the TP and DP groups of the default (world) group. Collective: every rank calls it,
        with the same ``tensor_parallel_size``. Without torch.distributed, returns :meth:`single`."""
        if not (dist.is_available() and dist.is_initialized()):
            if tensor_parallel_size != 1:
                raise ArgumentError(
                    f"tensor_parallel_size={tensor_parallel_size} needs torch.distributed to be initialized "
                    "(one process can only run tensor_parallel_size=1)"
                )
            return cls.single()
        world, rank = dist.get_world_size(), dist.get_rank()
        tp = int(tensor_parallel_size)
        if tp < 1 or world % tp:
            raise ArgumentError(
                f"tensor_parallel_size={tp} must be >= 1 and divide the world size {world} "
                f"(the grid is tensor_parallel_size x data_parallel_size)"
            )
        dp = world // tp
        tp_ranks = [[d * tp + t for t in range(tp)] for d in range(dp)]
        dp_ranks = [[d * tp + t for d in range(dp)] for t in range(tp)]
        # new_subgroups_by_enumeration creates every group on every rank (as new_group requires) and
        # returns the one this rank belongs to.
        tp_group, _ = dist.new_subgroups_by_enumeration(tp_ranks)
        dp_group, _ = dist.new_subgroups_by_enumeration(dp_ranks)
        _BUILT[(world, rank, tp)] = (tp_group, dp_group)
        return cls(world_size=world, rank=rank, tp_size=tp, tp_rank=rank % tp, dp_size=dp, dp_rank=rank // tp,
                   tp_group=tp_group, dp_group=dp_group)

    @property
    def replicated_id(self) -> Tuple[int, int]:
        """``replica_id`` of a tensor every rank holds whole (e.g. a LayerNorm weight): main replica on rank 0."""
        return (self.tp_rank, self.dp_rank)

    def describe(self) -> str:
        """One line for logs: ``rank 1/4: tp 1/2, dp 0/2``."""
        return f"rank {self.rank}/{self.world_size}: tp {self.tp_rank}/{self.tp_size}, dp {self.dp_rank}/{self.dp_size}"


#: The groups ParallelState.build made in this process, by (world size, rank, TP size), for unpickling.
_BUILT: Dict[Tuple[int, int, int], Tuple[dist.ProcessGroup, dist.ProcessGroup]] = {}


def _live(group: dist.ProcessGroup, size: int) -> bool:
    """``group`` is still a registered group of ``size`` ranks (not destroyed with its world)."""
    try:
        return dist.is_initialized() and dist.get_world_size(group) == size
    except (RuntimeError, ValueError):
        return False


def _rebuild(world_size: int, rank: int, tp_size: int, tp_rank: int, dp_size: int, dp_rank: int) -> ParallelState:
    """An unpickled :class:`ParallelState`: the groups ``build`` made for this layout in this process
    while they live, else none (a new run's strategy builds its own at setup)."""
    groups = _BUILT.get((world_size, rank, tp_size))
    if groups is None or not (_live(groups[0], tp_size) and _live(groups[1], dp_size)):
        world = dist.group.WORLD if tp_size == 1 and _live(dist.group.WORLD, world_size) else None
        groups = (None, world)  # data_parallel_world()'s, or none
    return ParallelState(world_size, rank, tp_size, tp_rank, dp_size, dp_rank, *groups)


def module_sharded_state_dict(module: nn.Module, prefix: str = "", replica_id: ReplicaId = 0) -> Dict[str, Any]:
    """A sharded state dict for ``module`` whose keys are ``module.state_dict()``'s (with ``prefix``).

    Submodules that define ``sharded_state_dict(prefix)`` describe their own tensors (e.g. the
    column- and row-parallel layers of ``examples/tp_layers.py``); every other tensor is a whole tensor replicated on
    every rank, with ``replica_id`` (pass :attr:`ParallelState.replicated_id`, so that exactly one rank writes it).
    Non-tensor extra state is kept as common state. ``module``'s own ``sharded_state_dict`` is not
    called, so a module can implement its ``sharded_state_dict`` with this function.
    """
    out: Dict[str, Any] = {}
    own: Dict[str, Any] = {}
    # nn.Module's own hook for "my parameters, persistent buffers and extra state, not my children's".
    # keep_vars: the parameters themselves are the data, so loads land in them and the optimizer
    # helpers can match optimizer state to parameters by identity.
    module._save_to_state_dict(own, "", keep_vars=True)
    for name, value in own.items():
        key = f"{prefix}{name}"
        if isinstance(value, torch.Tensor):
            out[key] = ShardedTensor.from_rank_offsets(key, value, replica_id=replica_id)
        else:
            out[key] = value
    for name, child in module.named_children():
        child_prefix = f"{prefix}{name}."
        if callable(getattr(child, "sharded_state_dict", None)):
            out.update(child.sharded_state_dict(prefix=child_prefix))
        else:
            out.update(module_sharded_state_dict(child, child_prefix, replica_id))
    return out


def data_parallel_world() -> ParallelState:
    """TP 1 x DP world over the default group (no new groups), or :meth:`ParallelState.single`."""
    if not (dist.is_available() and dist.is_initialized()):
        return ParallelState.single()
    world, rank = dist.get_world_size(), dist.get_rank()
    return ParallelState(world_size=world, rank=rank, tp_size=1, tp_rank=0, dp_size=world, dp_rank=rank,
                         tp_group=None, dp_group=dist.group.WORLD)


def parallel_state_of(module: Any) -> ParallelState:
    """The :class:`ParallelState` a LightningModule should build its layers for.

    The strategy's when the module is attached to a Trainer running a strategy that has one
    (:class:`~lightning_distckpt.lightning.DistCheckpointStrategy`); else plain data parallelism over the
    initialized world; else one process (e.g. for inference).
    """
    try:
        strategy = module.trainer.strategy
    except (AttributeError, RuntimeError):  # not a LightningModule / not attached to a Trainer
        strategy = None
    if strategy is not None and hasattr(type(strategy), "parallel_state"):
        return strategy.parallel_state  # raises if asked for before the strategy set up its groups
    return data_parallel_world()


def check_strategy_args(owner: str, tensor_parallel_size: Any, ddp_kwargs: Dict[str, Any]) -> int:
    """Validate a TP strategy's own arguments; drop DDP arguments it sets itself.

    ``process_group`` / ``device_mesh`` are the data-parallel group's business (LightningCLI passes
    DDP's defaults, None, which are dropped); returns the TP size as an int."""
    tp = tensor_parallel_size  # int(): 2.7 became 2 and True 1 silently, "x" or None a raw ValueError / TypeError
    if isinstance(tp, bool) or not isinstance(tp, numbers.Integral):
        raise ArgumentTypeError(f"{owner}: tensor_parallel_size must be an int, got {type(tp).__name__} {tp!r}")
    if tp < 1:
        raise ArgumentError(f"tensor_parallel_size must be >= 1, got {tensor_parallel_size}")
    for owned in ("process_group", "device_mesh"):
        if ddp_kwargs.pop(owned, None) is not None:
            raise ArgumentError(f"{owned} is set by {owner} (the data-parallel group); do not pass it")
    unknown = sorted(set(ddp_kwargs) - _ddp_parameters())
    if unknown:  # refused now, not by DistributedDataParallel(**kwargs) once the processes are launched
        raise ArgumentError(_unknown_argument(owner, unknown[0], ddp_kwargs[unknown[0]]))
    return int(tensor_parallel_size)


def _ddp_parameters() -> "set[str]":
    """The keyword arguments a DDP strategy takes: Lightning's and Fabric's ``DDPStrategy``, and
    ``DistributedDataParallel``'s, to which they pass the rest."""
    import inspect

    from lightning.fabric.strategies import DDPStrategy as FabricDDPStrategy
    from lightning.pytorch.strategies import DDPStrategy
    from torch.nn.parallel import DistributedDataParallel

    return {name for fn in (DDPStrategy.__init__, FabricDDPStrategy.__init__, DistributedDataParallel.__init__)
            for name in inspect.signature(fn).parameters}


def _unknown_argument(owner: str, key: str, value: Any) -> str:
    """What is wrong with ``key=value`` given to a TP strategy, and what to write instead."""
    from .config import unknown_argument

    return unknown_argument(owner, key, value, ["tensor_parallel_size", "checkpoint"],
                            "(checkpoint={{{key!r}: {value!r}}})",
                            sorted(_ddp_parameters()),
                            "It takes tensor_parallel_size, checkpoint (checkpoint settings: a DistCheckpointConfig, a "
                            "mapping or a YAML path) and the arguments of Lightning's DDPStrategy and of "
                            "DistributedDataParallel")


STRATEGY_NAME = "ddp_distckpt"


def register_strategy_names(cls: Any, strategy_registry: Any) -> None:
    """Register ``cls`` as ``ddp_distckpt`` (popen launcher) and ``ddp_distckpt_spawn`` in a
    Lightning or Fabric strategy registry (both have the same ``register`` API)."""
    for name, start_method in ((STRATEGY_NAME, "popen"), (f"{STRATEGY_NAME}_spawn", "spawn")):
        if name not in strategy_registry or is_placeholder(strategy_registry[name]):  # replaces registration.py's
            strategy_registry.register(
                name, cls, description=f"DDP with distributed checkpoints, start_method '{start_method}'",
                override=True, start_method=start_method,
            )
