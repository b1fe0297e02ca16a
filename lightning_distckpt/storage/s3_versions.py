"""Versions under ``s3://`` locations that no commit marker names: what killed saves left behind
(see :mod:`.s3` for the layout), found for ``inspect`` and removed by ``clean``.

Only what is provably ours is ever offered for removal: a ``v-<12 hex>`` prefix directly inside a
location whose ``COMMITTED`` object is absent or a marker of ours, holding nothing but the names a
save writes (``metadata.json``, ``common.pt``, ``data/rank_NNNNN/...``, no component empty, ``.`` or
``..``: a request for ``v-x/data/rank_00000/../../../y`` deletes ``y``). An object listing through
tensorstore's kvstore carries no modification times, so a version's age is read from its token
(the save's start time, :func:`.s3.new_version`) and from the liveness marks a running save adds
(:mod:`.s3_live`): a version seen running more recently than the caller's bound may be a save still
running on another node.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Dict, List, Optional

from ..core.errors import FormatError
from .layout import COMMIT_MARKER
from .options import StorageOptions
from .s3 import _VERSION, ObjectStore, checkpoint_url, delete_version, is_ours, read_marker
from .s3_live import mark_time, version_seen
from .s3_url import nameable, parse_s3_url
from .store import LeftoverChanged

logger = logging.getLogger(__name__)
#: A version seen running (its token's start time, its newest liveness mark) less than this ago may be a
#: save still writing it: ``clean``'s default ``--older-than``, and what a checkpoint's removal leaves in place.
LIVE_SAVE_S = 600.0


@dataclass(frozen=True)
class S3Leftover:
    """An uncommitted version under an ``s3://`` location, and what may be done with it."""

    path: str  # the version's URL
    target: str  # the checkpoint location it was meant to become
    objects: int
    idle_s: Optional[float]  # seconds since its save was last seen running (started, or marked live); None: unknown
    has_metadata: bool  # killed between metadata.json and the marker (every rank had written)
    foreign: Optional[str] = None  # why it is not provably ours (then never removed)
    nbytes: Optional[int] = None  # object sizes are not listed through the kvstore
    committed: bool = False  # never: the committed version is not a leftover
    alive_unix: Optional[float] = None  # its newest liveness mark when found (s3_live.py), None when none

    def verdict(self, older_than_s: float) -> str:
        """``"remove"``, or why it is kept: ``"foreign"``, ``"unknown-age"`` or ``"recent"``."""
        if self.foreign is not None:
            return "foreign"
        if self.idle_s is None:
            return "remove" if older_than_s <= 0 else "unknown-age"
        return "recent" if self.idle_s < older_than_s else "remove"

    def reason(self, verdict: str, older_than_s: float) -> str:
        """Why ``clean`` keeps or removes this version, in words (``verdict`` from :meth:`verdict`)."""
        if verdict == "foreign":
            return f"refused: not provably ours ({self.foreign})"
        if verdict == "unknown-age":
            return "its version name carries no start time; a save may still be running (--older-than 0 removes it)"
        if verdict == "recent":
            return (f"{self._seen()} {self.idle_s:.0f} s ago (< --older-than {older_than_s:.0f} s): a save may "
                    f"still be running")
        age = "" if self.idle_s is None else f", {self._seen()} {self.idle_s:.0f} s ago"
        return f"uncommitted ({self.objects} object(s){age})"

    def _seen(self) -> str:
        return "started" if self.alive_unix is None else "marked live by its save"


def _group(keys: List[str]) -> Dict[str, Dict[str, List[str]]]:
    """``{location: {version: [names inside it]}}`` for keys ``[loc/]v-<token>/name``; the leftmost
    version-like component decides (a version's own names hold none before it). A key with an
    empty, ``.`` or ``..`` component or a control character before its version (``a//v-.../x``) is
    at no location a save writes to (:func:`.s3_url.nameable`): it is left out, never offered for
    removal (the collapsed location's version of that name may be another one, not ours), and does
    not stop the others' cleaning."""
    found: Dict[str, Dict[str, List[str]]] = {}
    for key in keys:
        parts = key.split("/")
        for i, part in enumerate(parts[:-1]):
            if not nameable(part):
                break
            if _VERSION.match(part):
                found.setdefault("/".join(parts[:i]), {}).setdefault(part, []).append("/".join(parts[i + 1:]))
                break
    return found


def find_s3_leftovers(url: str, options: StorageOptions = StorageOptions()) -> List[S3Leftover]:
    """Uncommitted versions in the checkpoint at ``url`` or in any location under it (a
    ``ModelCheckpoint`` directory), oldest first. One listing, then one marker read per location."""
    root = parse_s3_url(url).url
    store = ObjectStore(root, options)
    store.check_bucket()  # a missing bucket or denied access is an error, not "nothing to clean"
    now = time.time()
    out = []
    for loc, versions in sorted(_group(store.list_keys()).items()):
        target = f"{root}/{loc}" if loc else root
        committed, foreign = None, None
        try:
            marker = read_marker(ObjectStore(target, options))
            committed = marker["version"] if marker else None
        except FormatError:
            foreign = f"{target}/{COMMIT_MARKER} is not a commit marker of ours"
        for name, inner in sorted(versions.items()):
            if name == committed:
                continue
            why = foreign
            odd = next((k for k in inner if not is_ours(k)), None)
            if why is None and odd is not None:
                why = f"holds {odd!r}, which no save of ours writes"
            seen = version_seen(name, inner)  # its start, or its save's newest liveness mark
            idle = None if seen is None else max(0.0, now - seen)
            out.append(S3Leftover(f"{target}/{name}", target, len(inner), idle, "metadata.json" in inner, why,
                                  alive_unix=mark_time(inner)))
    return sorted(out, key=lambda lo: -(lo.idle_s or 0.0))


def remove_version(leftover: S3Leftover, options: StorageOptions = StorageOptions()) -> None:
    """Delete the objects of an uncommitted version (after :meth:`S3Leftover.verdict` said so),
    checked again first, since the listing it was found in may be minutes old: LeftoverChanged,
    nothing deleted, when a marker now names it (a save older than ``--older-than`` committed it)
    or it now holds an object no save writes, or when its save marked it live since (:mod:`.s3_live`: still
    running, whatever ``--older-than`` said); only the objects listed then are deleted."""
    target, _, name = leftover.path.rpartition("/")
    store = ObjectStore(target, options)
    try:
        marker = read_marker(store)
    except FormatError as e:
        raise LeftoverChanged(f"{e}; {leftover.path} not removed") from None
    if marker is not None and marker["version"] == name:
        raise LeftoverChanged(f"{leftover.path}: committed meanwhile by a save that was still running "
                              f"(its {COMMIT_MARKER} now names it); not removed")
    alive = mark_time(k[len(name) + 1:] for k in store.list_keys(f"{name}/data/rank_00000/alive-"))
    if alive is not None and (leftover.alive_unix is None or alive > leftover.alive_unix):
        raise LeftoverChanged(f"{leftover.path}: its save marked it live {max(0.0, time.time() - alive):.0f} s ago, "
                              f"after it was listed: still running; not removed")
    odd = delete_version(store, name)
    if odd is not None:
        raise LeftoverChanged(f"{leftover.path}: now holds {odd!r}, which no save of ours writes; not removed")


def remove_checkpoint(url: str, options: StorageOptions = StorageOptions()) -> bool:
    """Delete the checkpoint at ``url``: its marker first (from then on it is no checkpoint), then
    its versions, committed or left behind, that hold only what a save writes. Other objects under
    the location stay (logged), and so does a version another save started or marked live less than
    :data:`LIVE_SAVE_S` ago (a second job saving to the same name: its commit would name a version
    whose objects were deleted; a directory's removal never touches the staging directory of a save
    to it either). FormatError, nothing deleted, when the ``COMMITTED`` object there is not a marker
    of ours; False when there was no checkpoint."""
    root = checkpoint_url(url)
    store = ObjectStore(root, options)
    marker = read_marker(store)
    if marker is None:
        return False
    store.delete(COMMIT_MARKER)
    now = time.time()
    for name, inner in sorted(_group(store.list_keys()).get("", {}).items()):
        seen = version_seen(name, inner)  # its start, or its save's newest liveness mark
        if name != marker["version"] and seen is not None and now - seen < LIVE_SAVE_S:
            logger.warning("%s/%s: left in place (seen running %.0f s ago: a save may still be writing it; `clean` "
                           "removes it once it is older than --older-than)", root, name, max(0.0, now - seen))
            continue
        odd = delete_version(store, name)
        if odd is not None:
            logger.warning("%s/%s: left in place (holds %r, which no save of ours writes)", root, name, odd)
    return True


def committed_children(url: str, first: str = "", options: StorageOptions = StorageOptions()) -> List[str]:
    """The URLs of the committed checkpoints directly under ``url`` whose names start with
    ``first`` (one listing of the objects under ``url/first``)."""
    root = parse_s3_url(url).url
    store = ObjectStore(root, options)
    store.check_bucket()  # bounded: a silent endpoint fails here, not after the listing's retries
    names = {k.split("/", 1)[0] for k in store.list_keys(first)
             if k.count("/") == 1 and k.endswith("/" + COMMIT_MARKER)}
    return [f"{root}/{name}" for name in sorted(names)]
