"""Does every rank hold the same common (non-sharded) state?

Only one copy of the common state is saved (rank 0's), so a value that differs on another rank
would be dropped without a word: a per-stage counter under pipeline parallelism, a rank-dependent
setting. Ranks exchange digests, never the state itself: one digest of the whole state on every
save, and per-leaf digests only when the whole digests disagree. Pure functions, no collectives.
"""

from __future__ import annotations

import hashlib
from typing import Any, Dict, List, Sequence, Tuple

from ..core.state_dict import iter_leaves
from ..storage.safe_pickle import dumps


def digest(data: bytes) -> str:
    """A short content digest (not a security hash: it only compares ranks' own bytes)."""
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def leaf_path(path: Sequence[Any]) -> str:
    """``("optimizer", "param_groups", 0, "lr")`` -> ``"optimizer.param_groups.0.lr"``."""
    return ".".join(str(p) for p in path) or "<root>"


def leaf_digests(common: Any) -> Dict[str, str]:
    """Digest of every leaf of the common state, by dotted path."""
    return {leaf_path(path): digest(dumps(leaf)) for path, leaf in iter_leaves(common)}


def common_differences(per_rank: Sequence[Dict[str, str]], limit: int = 10) -> List[str]:
    """Where ranks' leaf digests disagree with rank 0's (whose copy is the one saved).

    Returns one line per differing path (at most ``limit``, then a count of the rest), naming
    the ranks: a value that differs, or a path that only some ranks have.
    """
    reference = per_rank[0]
    paths = sorted(set().union(*per_rank))
    lines: List[str] = []
    for path in paths:
        if path not in reference:
            holders = [rk for rk, leaves in enumerate(per_rank) if path in leaves]
            lines.append(f"{path!r}: not on rank 0, only on ranks {holders} (not saved)")
            continue
        missing = [rk for rk, leaves in enumerate(per_rank) if path not in leaves]
        differ = [rk for rk, leaves in enumerate(per_rank) if path in leaves and leaves[path] != reference[path]]
        if differ:
            lines.append(f"{path!r}: differs from rank 0's value on ranks {differ}")
        if missing:
            lines.append(f"{path!r}: missing on ranks {missing}")
    if len(lines) > limit:
        lines = lines[:limit] + [f"... and {len(lines) - limit} more"]
    return lines


def rank_differences(per_rank: Sequence[Dict[str, str]], rank: int) -> Tuple[List[str], List[str], List[str]]:
    """Megatron-Core's three lists for ``rank`` against rank 0: the paths only rank 0 has, those
    only ``rank`` has, and those both have with different values."""
    reference, mine = per_rank[0], per_rank[rank]
    return (sorted(set(reference) - set(mine)), sorted(set(mine) - set(reference)),
            sorted(p for p in set(mine) & set(reference) if mine[p] != reference[p]))
