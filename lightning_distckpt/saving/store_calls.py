"""The calls a save makes of its store that must not fail one rank alone: what a store raises there is
agreed by every rank, or only warned about where the save does not need it (a third party's store may
raise anything: see ``docs/architecture.md``, "The store")."""

from __future__ import annotations

import logging
from typing import Optional, Sequence

from ..core.errors import CheckpointingError
from ..storage.base import ObjectWrite, ShardWrite, ShardWriter
from ..storage.save_token import TOKEN_FIELD, save_token
from ..storage.store import INTERRUPTS, CheckpointStore, ours

logger = logging.getLogger(__name__)

__all__ = ["INTERRUPTS", "UnopenedWriter", "agreed", "check_committed", "discard_quietly", "look_around_quietly",
           "open_writer"]


def agreed(error: BaseException) -> BaseException:
    """``error``, to be agreed with the other ranks; an interrupt is raised at once instead."""
    if isinstance(error, INTERRUPTS):
        raise error
    return error


def check_committed(store: CheckpointStore, staging: str, token: Optional[str] = None) -> Optional[CheckpointingError]:
    """After a third party's ``commit(staging, ...)`` returned: the error where the checkpoint its store holds now
    is not this save's (none, an older one, another save's), by the store's own view a load opens
    (``open_metadata``, its save ``token``, by default the staging location's). A commit that returned without
    committing made the save report success, and ModelCheckpoint's top-k and ``last`` link then pointed at
    nothing or at older state. A built-in store's commit raises on failure itself: not asked again (an object
    store's extra requests, a large metadata.json parsed again). The error has ``staging_kept``: not discarded,
    as a commit that took effect where ``open_metadata`` does not show it would lose the checkpoint."""
    if ours(store, "commit"):
        return None
    token = token or save_token(staging)
    try:
        now = store.open_metadata().meta.get(TOKEN_FIELD)
    except BaseException as e:  # a store's own BaseException too: agreed, no peer left waiting
        agreed(e)
        now = f"none to be opened ({type(e).__name__}: {e})"
    if now == token:
        return None
    error = CheckpointingError(f"{store!r}.commit({staging!r}) returned, but the checkpoint the store holds now is "
                               f"not this save's: save token {now!r}, this save's {token!r} (a commit that did not "
                               "commit, or committed other metadata); the store breaks the commit contract. The "
                               "staging location is left to `clean` (the store may have committed it)")
    error.staging_kept = True  # type: ignore[attr-defined]
    return error


def discard_quietly(store: CheckpointStore, staging: str) -> None:
    """After a failed save (rank 0): the staging location removed. A store whose ``discard`` raises leaves it
    to ``clean``, with a warning: its error must not replace, on rank 0 alone, the failure every rank raises."""
    try:
        store.discard(staging)
    except Exception as e:
        logger.warning("save to %s: %r.discard(%r) failed (the staging location is left behind; `clean` removes "
                       "it): %s: %s", store.location, store, staging, type(e).__name__, e)


class UnopenedWriter:
    """Stands for the writer a store failed to open on this rank: ``write_local`` raises ``error``."""

    backend = "unopened"

    def __init__(self, error: CheckpointingError) -> None:
        self.error = error

    def write(self, writer: int, tensors: Sequence[ShardWrite], objects: Sequence[ObjectWrite] = ()) -> int:
        raise self.error


def open_writer(store: CheckpointStore, staging: str) -> ShardWriter:
    """The store's writer for ``staging``, or an :class:`UnopenedWriter` saying why it opened none. Opened
    after the save's last collective of its preparation: a store failing here on one rank (its
    ``open_writer``, ``kvstore_spec`` or ``ts_context`` raising) fails that rank's writes, which every rank
    agrees on, instead of raising there alone while its peers wait for its writes."""
    try:
        return store.open_writer(staging)
    except BaseException as e:  # the step named even over an error that names the store's inner call
        agreed(e)
        error = CheckpointingError(f"{store!r}: open_writer({staging!r}) failed: {type(e).__name__}: {e}")
        error.__cause__ = e
        return UnopenedWriter(error)


def look_around_quietly(store: CheckpointStore, staging: str) -> None:
    """Rank 0's look for leftovers of earlier saves: a warning only, so a store that cannot look must not
    fail rank 0 alone while its peers wait for the plan."""
    try:
        store.look_around(staging)
    except Exception as e:
        logger.warning("save to %s: %r.look_around failed (leftovers of earlier saves not looked for): %s: %s",
                       store.location, store, type(e).__name__, e)
