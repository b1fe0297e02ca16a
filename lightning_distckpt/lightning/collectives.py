"""Lightning's collectives on our strategies, their tensors kept until gloo's worker has let go of them.

A Lightning program's last line is often ``trainer.fit(...)``: the last collectives before the interpreter
exits are then Lightning's own (``self.log(..., sync_dist=True)``'s reduce, ``reduce_boolean_decision``,
the strategy's ``broadcast``), which hand gloo tensors that Python drops at once. When gloo's worker lets go
of such a tensor during interpreter shutdown, the process aborts ("terminate called without an active
exception", pytorch/pytorch#179291; a 2-process fit under our strategy aborted on rank 1 in 9 of 40 idle
runs). Our strategies route these collectives through :mod:`lightning_distckpt.comm_bytes`, as every
collective of the library is: the same values as stock's, and an exit that does not abort.

What is left to stock: ``all_gather(..., sync_grads=True)`` (an autograd function holds its tensors), the
barrier (it hands gloo no tensor of Python's), and collectives on accelerators (they complete asynchronously,
and no worker thread releases a Python object).
"""

from __future__ import annotations

import pickle
from typing import Any, Optional, TypeVar

import torch
import torch.distributed as dist

from ..comm import comm_device
from ..comm_bytes import all_gather_tensor, broadcast_bytes, released

T = TypeVar("T")


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


class _CollectivesMixin:
    """What the Trainer's and Fabric's strategies share: ``broadcast`` and ``all_gather``."""

    def broadcast(self, obj: T, src: int = 0) -> T:
        """``obj`` of global rank ``src`` on every rank, as stock's ``broadcast_object_list`` over the world
        gives it (``src`` keeps its own object)."""
        if not _initialized():
            return obj
        group = dist.group.WORLD
        mine = dist.get_rank() == src
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL) if mine else None
        received = broadcast_bytes(group, data, src, comm_device(group))
        return obj if mine else pickle.loads(received)

    def all_gather(self, tensor: torch.Tensor, group: Optional[Any] = None, sync_grads: bool = False) -> torch.Tensor:
        """Every rank's ``tensor``, stacked in rank order (shape ``(world, *tensor.shape)``), as stock."""
        if sync_grads or not _initialized():
            return super().all_gather(tensor, group=group, sync_grads=sync_grads)  # type: ignore[misc]
        with torch.no_grad():
            return torch.stack(all_gather_tensor(group, tensor.contiguous()))


class TrainerCollectivesMixin(_CollectivesMixin):
    """For a Trainer's strategy (``lightning.pytorch``): ``reduce``, ``broadcast``, ``all_gather``."""

    def reduce(self, tensor: Any, group: Optional[Any] = None, reduce_op: Optional[Any] = "mean") -> Any:
        """Stock's reduce (in place on ``tensor``), ``tensor`` kept until the backend has let go of it."""
        call = super().reduce  # type: ignore[misc]
        if not isinstance(tensor, torch.Tensor):
            return call(tensor, group, reduce_op)
        return released(lambda: call(tensor, group, reduce_op), [tensor])


class FabricCollectivesMixin(_CollectivesMixin):
    """For a Fabric strategy (``lightning.fabric``): ``all_reduce``, ``broadcast``, ``all_gather``."""

    def all_reduce(self, tensor: Any, group: Optional[Any] = None, reduce_op: Optional[Any] = "mean") -> Any:
        """Stock's all_reduce (in place on ``tensor``), ``tensor`` kept until the backend has let go of it."""
        call = super().all_reduce  # type: ignore[misc]
        if not isinstance(tensor, torch.Tensor):
            return call(tensor, group, reduce_op)
        return released(lambda: call(tensor, group, reduce_op), [tensor])
