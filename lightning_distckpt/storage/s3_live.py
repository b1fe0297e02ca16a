"""A running ``s3://`` save's version, kept from being taken for a killed save's leftover.

An object listing through the kvstore carries no modification times, so ``clean`` and a checkpoint's
removal date a version by its name (the save's start time, :func:`.s3.version_token`): a save running
longer than their bound (600 s by default) would have its objects deleted under it. So rank 0, from
the moment it names a version until its commit or discard, marks it live every :func:`alive_period`
seconds with an empty object ``data/rank_00000/alive-<8 hex Unix seconds>`` (a name a save writes:
older versions of the library still treat it as ours), deleting the previous mark; a version's age
is then the time since the newest of its start and its marks (:func:`version_seen`). A killed or
stopped save marks nothing more and becomes removable after the bound, as before.

Should a removal still reach a running save (``clean --older-than 0``, a save whose process was
stopped past the bound, a lifecycle rule), its commit finds it (:func:`check_complete`): the marker is
written only when the version still holds its claim (the first object a save writes, so the first one
any removal's listing holds) and every writer's store.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
import weakref
from typing import Any, Iterable, List, Optional

from ..core.errors import CheckpointingError
from .layout import DATA_DIR
from .options import StorageOptions
from .s3 import _CLAIM, ObjectStore, version_started
from .s3_url import answer_timeout, seconds_from_env

logger = logging.getLogger(__name__)

#: Seconds between two liveness marks of a running save: one small PUT (and a DELETE) each, against
#: removal bounds of 600 s, so a mark or two may fail without the version looking dead.
ALIVE_PERIOD_S = 60.0
#: Overrides :data:`ALIVE_PERIOD_S` (seconds, a positive number): tests lower it.
ALIVE_PERIOD_ENV = "LIGHTNING_DISTCKPT_S3_ALIVE_S"
_ALIVE = "data/rank_00000/alive-"
_ALIVE_KEY = re.compile(r"^data/rank_00000/alive-([0-9a-f]{8})\Z")
_OUR_MARKS = (_CLAIM.rpartition("/")[2], _ALIVE.rpartition("/")[2])  # in rank 0's store, not its arrays
#: This process's keepers, for :func:`running_keepers` only (each is held by the store of its save).
_RUNNING: "weakref.WeakSet[_Keeper]" = weakref.WeakSet()


def alive_period() -> float:
    """:data:`ALIVE_PERIOD_S`, or the value of :data:`ALIVE_PERIOD_ENV` (ArgumentError naming it when bad)."""
    return seconds_from_env(ALIVE_PERIOD_ENV, ALIVE_PERIOD_S, "between two liveness marks of a running s3:// save")


def mark_time(inner: Iterable[str]) -> Optional[float]:
    """The newest liveness mark among ``inner`` (names inside one version), None when none; a mark
    dated more than a day ahead is ignored, as a start time is (:func:`.s3.version_started`)."""
    latest = time.time() + 86400
    times = [float(int(m.group(1), 16)) for m in map(_ALIVE_KEY.match, inner) if m is not None]
    return max((t for t in times if 1_500_000_000 <= t <= latest), default=None)


def version_seen(name: str, inner: Iterable[str]) -> Optional[float]:
    """When the save of version ``name`` (holding ``inner``) was last known running: the newest of
    its start time and its liveness marks; None when neither is known."""
    times = [t for t in (version_started(name), mark_time(inner)) if t is not None]
    return max(times) if times else None


class _Keeper:
    """Rank 0's marks of one running version (a daemon thread: it dies with the process)."""

    def __init__(self, version_url: str, options: StorageOptions, period: float) -> None:
        self.url = version_url
        self.period = period
        self.stopped = threading.Event()
        self._store = ObjectStore(version_url, options)  # opened here: a bad spec fails the naming, not later
        self._thread = threading.Thread(target=self._run, name=f"ldc-s3-alive {version_url}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        previous, warned = None, False
        while not self.stopped.wait(self.period):
            name = f"{_ALIVE}{int(time.time()):08x}"
            try:
                self._store.write(name, b"")
                if previous is not None and previous != name:
                    self._store.delete(previous)  # only the newest counts: keep one or two
                previous = name
            except Exception as e:  # noqa: BLE001 - a missed mark is retried; the save's own requests fail
                if not warned:  # the endpoint failing fails the save's writes too: say it once
                    logger.warning("%s: marking the running save live failed (%s); retried every %.0f s", self.url,
                                   e, self.period)
                    warned = True

    def stop(self) -> None:
        """Stop marking, and wait for a mark being written (bounded: a small request), so that none lands
        in a version after its discard listed it."""
        self.stopped.set()
        if self._thread is not threading.current_thread():
            self._thread.join(answer_timeout() + 5.0)


def keep_alive(version_url: str, options: StorageOptions, owner: Any) -> "_Keeper":
    """Rank 0, once it named ``version_url``: mark it live until the returned keeper's ``stop()`` (the
    save's store calls it at the commit or discard), or until ``owner`` (that store) is collected: a save
    abandoned on a path that neither commits nor discards (a rank lost in the handshake) stops marking then."""
    keeper = _Keeper(version_url, options, alive_period())
    _RUNNING.add(keeper)
    weakref.finalize(owner, keeper.stopped.set)  # no join: this may run on whatever thread collected it
    return keeper


def running_keepers() -> List[str]:
    """The versions this process marks live now (for tests and diagnostics)."""
    return [k.url for k in list(_RUNNING) if not k.stopped.is_set()]


def _writers(metadata_json: str, where: str) -> List[int]:
    """The ranks whose stores ``metadata.json``'s index says hold data (as ``validate`` reads it)."""
    from ..planning.metadata import CheckpointIndex  # the planner imports storage modules

    index = CheckpointIndex.from_json(json.loads(metadata_json), where)
    writers = {w for w, n in index.bytes_per_writer().items() if n > 0}
    writers |= {s.writer for o in index.objects.values() for s in o.shards}
    return sorted(writers)


def check_complete(version_url: str, metadata_json: str, options: StorageOptions) -> None:
    """Rank 0, right before the commit: CheckpointingError, nothing committed, when objects of the
    version were deleted while its save ran. One listing: the version's claim (written before any
    rank wrote, so any removal's listing held it and deleted it) and each writer's store (an object
    under ``data/rank_NNNNN/`` other than our marks) must be there."""
    listed = ObjectStore(version_url, options).list_keys(DATA_DIR + "/")
    if not any(k.startswith(_CLAIM) for k in listed):
        raise CheckpointingError(f"checkpoint {version_url}: objects of this save were deleted while it ran (its claim "
                                 f"{_CLAIM}* is gone: a `clean` or a checkpoint removal took it for a leftover); "
                                 f"nothing was committed")
    stores = {k.split("/", 2)[1] for k in listed if k.count("/") >= 2 and not k.split("/")[2].startswith(_OUR_MARKS)}
    missing = [w for w in _writers(metadata_json, version_url) if f"rank_{w:05d}" not in stores]
    if missing:
        raise CheckpointingError(f"checkpoint {version_url}: the store of rank(s) {missing[:8]} is missing (no object "
                                 f"under {DATA_DIR}/rank_{missing[0]:05d}/: deleted while the save ran); nothing was "
                                 f"committed")
