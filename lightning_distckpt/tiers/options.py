"""Options of the node-local checkpoint tier and the recovery point it agrees on.

:class:`TierOptions` is what a user (or the Lightning layer) configures; :class:`RecoveryPoint` is the
answer of :meth:`LocalTier.recoverable`: the newest step every rank can restore and where from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from lightning_distckpt.core.errors import ArgumentError, ArgumentTypeError

#: The sources a recovery point can name.
RECOVERY_SOURCES = ("local", "durable")


def _check_int(name: str, value: object, minimum: int, allow_none: bool = False) -> None:
    """Raise ArgumentTypeError / ArgumentError naming ``name`` unless ``value`` is an int >= minimum."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise ArgumentTypeError(f"TierOptions.{name} must be an int, got {type(value).__name__}: {value!r}")
    if value < minimum:
        raise ArgumentError(f"TierOptions.{name} must be >= {minimum}, got {value}")


@dataclass(frozen=True)
class TierOptions:
    """Configuration of the node-local tier.

    ``local_dir`` is the node-local root (``/dev/shm/ckpt``, a local NVMe path); a ``"{node}"`` in it is
    replaced by this rank's node name (tests give each simulated node its own directory).
    ``local_every_n_steps`` and ``durable_every_n_steps`` are read by the Lightning layer, not by
    :class:`LocalTier`. At most ``keep_local`` local checkpoints are kept per node, the one being written
    included (with 1, nothing local is recoverable while a save is in flight); ``replicas``
    partner copies of each rank's shards are kept on other nodes. ``node`` overrides the node name
    (default: the host name, split by the launcher's ``LOCAL_RANK`` / ``LOCAL_WORLD_SIZE`` where one host
    name runs several launched nodes, :mod:`.nodes`); ``ranks_per_node`` simulates nodes
    (``node = f"node{rank // ranks_per_node}"``). ``max_staging_bytes`` bounds the host memory a local
    save adds (``AsyncSaver(max_staging_bytes=...)``: the snapshot and the writer's buffers).
    """

    local_dir: str
    local_every_n_steps: int = 50
    keep_local: int = 2
    replicas: int = 1
    durable_every_n_steps: Optional[int] = None
    node: Optional[str] = None
    ranks_per_node: Optional[int] = None
    max_staging_bytes: Optional[int] = None

    def __post_init__(self) -> None:
        if not isinstance(self.local_dir, str):
            raise ArgumentTypeError(
                f"TierOptions.local_dir must be a str, got {type(self.local_dir).__name__}"
            )
        if not self.local_dir.strip():
            raise ArgumentError("TierOptions.local_dir must be a non-empty path")
        if "://" in self.local_dir:
            raise ArgumentError(
                f"TierOptions.local_dir must be a node-local file system path, got {self.local_dir!r}"
            )
        _check_int("local_every_n_steps", self.local_every_n_steps, 1)
        _check_int("keep_local", self.keep_local, 1)
        _check_int("replicas", self.replicas, 0)
        _check_int("durable_every_n_steps", self.durable_every_n_steps, 1, allow_none=True)
        _check_int("ranks_per_node", self.ranks_per_node, 1, allow_none=True)
        _check_int("max_staging_bytes", self.max_staging_bytes, 1, allow_none=True)
        if self.node is not None:
            if not isinstance(self.node, str):
                raise ArgumentTypeError(
                    f"TierOptions.node must be a str, got {type(self.node).__name__}"
                )
            check_node_name(self.node)
        if self.node is not None and self.ranks_per_node is not None:
            raise ArgumentError("TierOptions.node and TierOptions.ranks_per_node are exclusive; give one")


def check_node_name(name: str) -> None:
    """Node names become directory names: refuse empty names, separators and dot names."""
    if not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name:
        raise ArgumentError(f"TierOptions.node is not a usable node name: {name!r}")


@dataclass(frozen=True)
class RecoveryPoint:
    """The newest step every rank can restore: from the node-local tiers (own or partners' copies),
    or from the durable checkpoint at ``path``.

    Attributes:
        step: the training step (an int >= 0, else an ArgumentError).
        source: ``"local"`` (the node-local tiers) or ``"durable"`` (the checkpoint at ``path``).
        path: the durable checkpoint's path; required with ``source="durable"``.
    """

    step: int
    source: str
    path: Optional[str] = None

    def __post_init__(self) -> None:
        if isinstance(self.step, bool) or not isinstance(self.step, int) or self.step < 0:
            raise ArgumentError(f"RecoveryPoint.step must be an int >= 0, got {self.step!r}")
        if self.source not in RECOVERY_SOURCES:
            raise ArgumentError(
                f"RecoveryPoint.source must be one of {RECOVERY_SOURCES}, got {self.source!r}"
            )
        if self.source == "durable" and not self.path:
            raise ArgumentError("RecoveryPoint.path must name the durable checkpoint when source='durable'")
