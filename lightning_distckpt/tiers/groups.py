"""The tiers' gloo groups, one per set of ranks for the life of the process.

Each :class:`~lightning_distckpt.tiers.LocalTier` needs a gloo group of its own (its background thread
must not race the training's collectives). Lightning makes one tier per ``fit``/``test`` call, and a
group cannot safely be destroyed while the world lives, so a new group per tier would accumulate groups
(and their sockets) in a long process. Tiers over the same ranks share one group instead: two tiers of
one process never talk over it at once: a tier taking the group first waits for the background work of
the tier that had it before (every rank's old tier runs the same collectives, so those waits end
together), and the caller's thread of a tier uses the group only while its own background work is
done. A new world (``destroy_process_group``
then ``init_process_group``) gets new groups: the cache is keyed by the world group object too.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Dict, Optional, Protocol, Tuple

import torch.distributed as dist

from ..comm import new_gloo_group

_lock = threading.Lock()
_groups: Dict[Tuple[Any, Optional[Tuple[int, ...]]], Tuple[Any, Any]] = {}  # key -> (group, weakref of its user)


class GroupUser(Protocol):
    def quiesce(self) -> None:
        """Let the background work using the group finish (without raising what failed)."""


def tier_group(ranks: Optional[Tuple[int, ...]], user: GroupUser) -> Any:
    """Collective over the world (the first time for these ``ranks``, as ``dist.new_group``): the gloo
    group over ``ranks`` (None: the whole world), made once per world and reused afterwards, now for
    ``user`` (the previous user's background work finished first). Every rank asks for the same ranks in
    the same order, so every rank makes (or reuses) the same groups."""
    world = dist.group.WORLD
    with _lock:
        for key in [k for k in _groups if k[0] is not world]:  # groups of a destroyed world are dead
            del _groups[key]
        key = (world, ranks)
        if key in _groups:
            group, previous = _groups[key]
            before = previous()
            if before is not None and before is not user:
                before.quiesce()
        else:
            group = new_gloo_group(list(ranks) if ranks is not None else None)
        _groups[key] = (group, weakref.ref(user))
        return group


def cached_groups() -> int:
    """How many tier groups this process holds (tests)."""
    with _lock:
        return len(_groups)
