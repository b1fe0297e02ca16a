"""Checkpoint tiers: node-local checkpoints with partner copies, and recovery from the fastest tier.

Contract with the Lightning layer: /work/notes/tiers_contract.md. Changes to it are written here.
"""

from lightning_distckpt.tiers.local_tier import LocalTier
from lightning_distckpt.tiers.options import RecoveryPoint, TierOptions

__all__ = ["LocalTier", "RecoveryPoint", "TierOptions"]
