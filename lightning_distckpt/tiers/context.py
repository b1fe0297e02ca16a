"""What every part of the tier needs to know about this rank: its options, the tier's own process group,
every rank's node and this node's local root."""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from typing import Optional

from lightning_distckpt.comm import Comm
from lightning_distckpt.storage.commit import KILL_AT_ENV, STOP_AT_ENV
from lightning_distckpt.tiers.node_store import SCHEME, step_dir
from lightning_distckpt.tiers.nodes import NodeMap
from lightning_distckpt.tiers.options import TierOptions

#: Points of a local save where tests may kill (or stop) a rank, as the commit's steps (storage/commit.py).
TIER_STEPS = ("tier_before_place", "tier_before_note")


def test_point(name: str) -> None:
    """Test hook: stop or kill this process at ``name`` when the environment lists it (see storage/commit.py)."""
    for env, sig in ((STOP_AT_ENV, signal.SIGSTOP), (KILL_AT_ENV, signal.SIGKILL)):
        if name in os.environ.get(env, "").split(","):
            os.kill(os.getpid(), sig)


#: Names of the tier's temporary directories under a node root (transfers in progress): never a checkpoint.
TMP_PREFIX = ".ldc-tier-tmp-"


@dataclass(frozen=True)
class TierContext:
    """This rank's view of the tier (one per :class:`~lightning_distckpt.tiers.LocalTier`)."""

    options: TierOptions
    comm: Comm  # the tier's own gloo group: its background thread never races the training's collectives
    nodes: NodeMap
    root: str  # this rank's node-local root
    run: Optional[str] = None  # the run this tier saves as and recovers (None: any step, none recorded)

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def node(self) -> str:
        return self.nodes.node_of(self.comm.rank)

    @property
    def is_lead(self) -> bool:
        return self.nodes.is_lead(self.comm.rank)

    @property
    def copies(self) -> int:
        return self.nodes.copies(self.options.replicas)

    def step_dir(self, step: int) -> str:
        return step_dir(self.root, step)

    def location(self, step: int) -> str:
        """The save pipeline's location of this node's step directory (served by NodeLocalStore)."""
        return SCHEME + self.step_dir(step)

    def tmp_dir(self, step: int, label: str) -> str:
        """Where an item of ``step`` being received lands before it is renamed into place."""
        return os.path.join(self.root, f"{TMP_PREFIX}{step:09d}-{label}")
