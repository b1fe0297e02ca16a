"""LocalTier: node-local checkpoints with partner copies, and recovery from the fastest tier."""

from __future__ import annotations

from typing import Any, Dict, Optional, Sequence, Tuple

from lightning_distckpt.tiers.options import RecoveryPoint, TierOptions


class LocalTier:
    """Node-local checkpoint tier of one rank (collective object: every rank makes one)."""

    def __init__(self, options: TierOptions, process_group: Optional[Any] = None) -> None:
        self.options = options
        self.process_group = process_group

    def save(self, sharded_state_dict: Dict[str, Any], step: int) -> None:
        """Collective. Waits for the previous local save (and its replication) to finish, then snapshots
        this rank's shards and returns; writing, commit and replication finish in the background."""
        raise NotImplementedError("LocalTier.save: in progress")

    def wait(self) -> None:
        """Collective. Finishes the in-flight local save and replication (raises what failed)."""
        raise NotImplementedError("LocalTier.wait: in progress")

    def recoverable(self, durable: Sequence[Tuple[int, str]] = ()) -> Optional[RecoveryPoint]:
        """Collective. The newest step for which every shard is held and verified somewhere."""
        raise NotImplementedError("LocalTier.recoverable: in progress")

    def load(self, sharded_state_dict: Dict[str, Any], point: RecoveryPoint, **load_kwargs: Any) -> Dict[str, Any]:
        """Collective. Loads ``point`` as lightning_distckpt.load would."""
        raise NotImplementedError("LocalTier.load: in progress")

    def close(self) -> None:
        """Finishes what is in flight and releases the tier's resources."""
