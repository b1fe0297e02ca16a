"""Checkpoint tiers: node-local checkpoints with partner copies, and recovery from the fastest tier.

Contract with the Lightning layer: /work/notes/tiers_contract.md. Changes to it and what it left open:

- ``LocalTier(options, process_group)`` is collective over the **world** group (the first tier over
  these ranks makes a gloo group with ``dist.new_group``, which every process of the world enters; later
  tiers over the same ranks reuse it, :mod:`.groups`, so a process making a tier per ``fit`` does not
  accumulate groups; the tier the group is taken from finishes its background work and refuses further
  use). Its background thread (commit, replication, pruning) talks over that group only.
- ``keep_local`` counts the step being written: when a local save starts, a node keeps only the
  ``keep_local - 1`` newest committed steps (at most ``keep_local`` directories per node at any time;
  with 1, nothing local is recoverable while a save is in flight). Steps newer than the one saved (an
  abandoned run's) are removed.
- ``replicas`` above the number of other nodes keeps one copy per other node, with a warning.
- ``save`` raises the previous save's failure (SaveFailedError, on every rank), as ``wait`` does; every
  rank must pass the same ``step`` (else ArgumentError on every rank, at ``wait`` / the next ``save``).
- ``recoverable`` and ``load`` first wait for a save in flight. ``recoverable``: rank 0's ``durable``
  list decides; at equal steps the local tiers win. ``load(..., **load_kwargs)``: kwargs go to
  ``lightning_distckpt.load`` (not ``process_group``: the tier's is used). Chunk checksums of local copies
  are verified as the load reads them: a damaged copy is set aside (WARNING naming it) and the load retried,
  agreed by every rank, from another copy, else (first load after ``recoverable`` only) an older local step
  or a durable checkpoint; ``LocalTier.last_point`` says which point was read. A later ``load`` of the same
  point (the optimizer after the module) skips the listing, checks and fetch when every rank's node already
  holds what it reads (until the next ``save``).
- Added: ``LocalTier.node`` and ``LocalTier.root`` (this rank's node name and node-local root),
  ``LocalTier.last_point``.
"""

from lightning_distckpt.tiers.local_tier import LocalTier
from lightning_distckpt.tiers.options import RecoveryPoint, TierOptions

__all__ = ["LocalTier", "RecoveryPoint", "TierOptions"]
