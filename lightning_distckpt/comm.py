"""Collectives over a process group, degrading to single-process no-ops when torch.distributed
is not initialized. Every collective the library makes goes through here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Comm:
    """A process group (or none) with this process's rank and the group size."""

    group: Optional[dist.ProcessGroup]
    rank: int
    size: int

    @property
    def distributed(self) -> bool:
        return self.size > 1

    def global_rank(self, group_rank: int) -> int:
        if not dist.is_initialized():
            return group_rank
        return dist.get_global_rank(self.group or dist.group.WORLD, group_rank)

    def all_gather_object(self, obj: Any) -> List[Any]:
        if not self.distributed:
            return [obj]
        out: List[Any] = [None] * self.size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Broadcast from group rank ``src``."""
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=self.global_rank(src), group=self.group)
        return box[0]

    def barrier(self) -> None:
        if self.distributed:
            # all_reduce rather than dist.barrier: gloo's barrier ignores device placement issues,
            # and an all_reduce doubles as a liveness check with the group's timeout.
            t = torch.zeros(1)
            dist.all_reduce(t, group=self.group)


def get_comm(process_group: Optional[dist.ProcessGroup] = None) -> Comm:
    """The Comm for ``process_group`` (default: the world group; none when not initialized)."""
    if not (dist.is_available() and dist.is_initialized()):
        if process_group is not None:
            raise RuntimeError("a process_group was given but torch.distributed is not initialized")
        return Comm(None, 0, 1)
    return Comm(process_group, dist.get_rank(process_group), dist.get_world_size(process_group))
