"""Checkpoints in S3-compatible object storage, committed without a rename.

::

    s3://bucket/prefix/
      COMMITTED              the commit marker: names the committed version and records the SHA-256
                             of its metadata.json and common.pt; written last, by rank 0
      v-<token>/             one save (the token is its staging name, fresh per save)
        metadata.json, common.pt, data/rank_NNNNN/   as in a checkpoint directory (layout.py)

Ranks write under a fresh version prefix; rank 0 then writes ``metadata.json``, reads
``common.pt`` back to hash it and replaces the marker (one PUT: atomic). Readers trust only the
marker, so a reader never sees a mix of two saves, and a save that fails or is killed before its
marker leaves the previous checkpoint loadable. After the new marker is in place the previous
version's objects are deleted. Everything (arrays through OCDBT, metadata, common state, marker)
goes through tensorstore's ``s3`` kvstore.
"""

from __future__ import annotations

import json
import logging
import re
import secrets
import time
from typing import Any, Dict, List, Optional, Tuple

import tensorstore as ts

from ..core.errors import ArgumentError, CheckpointingError, FormatError, IncompleteCheckpointError
from .checksums import sha256_hex
from .layout import (COMMIT_MARKER, COMMON_FILE, FILE_CAPS, METADATA_FILE, MetadataFile, check_metadata,
                     parse_marker)
from .options import StorageOptions
from .paths import MARKER_CAP, SizeCap
from .kv_probe import ends_before, holds_byte, read_past
from .s3_reads import object_size, read_bounded, what_is_there
from .ts_context import child_context
from .s3_url import (answer_timeout, context_spec, explain, kvstore_spec, list_timeout, nameable, no_answer,
                     parse_s3_url, unended_listing)

logger = logging.getLogger(__name__)

VERSION_PREFIX = "v-"
_OWN_FILE = SizeCap("file this save wrote", 1 << 62)
_VERSION = re.compile(r"^v-[0-9a-f]{12}\Z")  # \Z: $ also matches before a final newline
# Everything a save writes inside its version (layout.py: metadata, common state, per-rank stores).
_OUR_KEY = re.compile(r"^(metadata\.json|common\.pt|data/rank_[0-9]{5}/.+)\Z")
# Attempts at opening a checkpoint whose marker moved on between its read and the metadata's (an
# overwrite commits, then deletes the version just read): each is a newer save, so a few suffice.
_OPEN_ATTEMPTS = 3
# Requests moving at most this many bytes are waited on for at most answer_timeout() as a whole;
# larger ones (metadata.json, common.pt) may rightly take longer, and are bounded by curl's stall
# limit per attempt (docs/object_storage.md).
_SMALL = 1 << 20
# The claim of a version by the save naming it (new_version): an object of a name a save writes, beside a
# rank store's own (ignored by OCDBT and zarr, which read only the names they wrote).
_CLAIM, _NAME_ATTEMPTS = "data/rank_00000/claim-", 8


def addressable(name: str) -> bool:
    """Whether a request for the key ``name`` reaches that object: the ``.`` and ``..`` components
    of a request's URL path are resolved on the way (curl), so ``v-x/data/../../../x`` read, written
    or deleted is the object ``x``, outside the location, and the listed object itself is never hit."""
    return not any(part in (".", "..") for part in name.split("/"))


def is_ours(inner: str) -> bool:
    """Whether ``inner`` (a key inside a version) is a name a save writes: :data:`_OUR_KEY`, each
    component nameable (no empty, ``.`` or ``..`` one, no control character: our writers make none)."""
    return _OUR_KEY.match(inner) is not None and all(nameable(part) for part in inner.split("/"))


class ObjectStore:
    """Whole objects under one ``s3://`` location, through tensorstore's ``s3`` kvstore; every
    failure a CheckpointingError naming the URL and why, in one line."""

    def __init__(self, url: str, options: StorageOptions) -> None:
        self.url = parse_s3_url(url).url
        self.options = options
        spec = kvstore_spec(self.url, options)
        try:  # no request yet: only the spec is checked
            self._kv = ts.KvStore.open(spec, context=child_context(context_spec(options))).result()
        except Exception as e:
            raise self._error("opening the store", e) from None

    def _error(self, what: str, e: BaseException) -> CheckpointingError:
        return CheckpointingError(f"checkpoint {self.url}: {what} failed: {explain(e, self.options)}")

    def _key(self, name: str) -> str:
        """``name``, refused before any request when the request would reach another object (:func:`addressable`)."""
        if not addressable(name):
            raise CheckpointingError(f"checkpoint {self.url}: refusing the object name {name[:200]!r}: its '.' or "
                                     f"'..' component would make the request reach another object")
        return name

    def _wait(self, future: Any, what: str, small: bool = True) -> Any:
        """``future``'s result; for a ``small`` request, a CheckpointingError naming the endpoint
        when no answer came within :func:`.s3_url.answer_timeout` (the request is then cancelled)."""
        timeout = answer_timeout() if small else None
        try:
            return future.result(timeout=timeout)
        except TimeoutError as e:
            if future.done():  # tensorstore's own deadline: an error like any other
                raise self._error(what, e) from None
            future.cancel()
            raise CheckpointingError(f"checkpoint {self.url}: {what} failed: "
                                     f"{no_answer(self.options, timeout or 0.0)}") from None
        except Exception as e:
            raise self._error(what, e) from None

    def read(self, name: str, cap: Optional[SizeCap] = None) -> Optional[bytes]:
        """The object ``name`` (relative to the location), None when missing. An object larger than
        ``cap`` (by default the one of a checkpoint file of that name, else a marker's) is a
        FormatError naming it, and is not fetched: the read itself is bounded (:func:`.s3_reads.read_bounded`:
        an object replaced by a larger one after its size was found is read no further than that size)."""
        cap = cap or FILE_CAPS.get(name.rpartition("/")[2], MARKER_CAP)
        limit = cap.limit()
        data, size = read_bounded(self, self._key(name), limit)
        if size > limit:
            raise cap.refusal(f"object {self.url}/{name}", None, limit)
        return data

    def size(self, name: str, limit: int) -> Optional[int]:
        """The size of the object ``name`` (None when missing, ``limit + 1`` past ``limit``), found
        with ranged reads of at most 1 MiB each (:func:`.s3_reads.object_size`), not by reading it."""
        return object_size(self, self._key(name), limit)

    def _larger_than(self, name: str, limit: int) -> bool:
        """Whether the object ``name`` holds more than ``limit`` bytes, asked without fetching it
        (the kvstore lists no sizes): a read of its byte ``limit`` alone, which tensorstore answers
        OUT_OF_RANGE when the object is shorter. False when it is missing."""
        future = read_past(self._kv, self._key(name), limit)
        try:
            res = self._wait(future, f"reading {name}")
        except CheckpointingError:
            if not future.cancelled() and ends_before(future.exception()):
                return False
            raise
        return holds_byte(res)

    def write(self, name: str, data: bytes) -> None:
        self._wait(self._kv.write(self._key(name), data), f"writing {name}", len(data) <= _SMALL)

    def check_bucket(self) -> None:
        """One listing request: raises when the bucket is missing, access is denied or the endpoint
        is unreachable (a read of a missing object in a missing bucket is just 'missing')."""
        self._wait(self._kv.list(ts.KvStore.KeyRange(COMMIT_MARKER, COMMIT_MARKER + "\0")), "checking the bucket")

    def list_keys(self, prefix: str = "") -> List[str]:
        """The names of every object under ``prefix`` (relative to the location), sorted."""
        what, timeout = f"listing {prefix or 'the objects'}", list_timeout()
        try:  # bounded as a whole (s3_url.S3_LIST_TIMEOUT_ENV): a server's pages may never end
            future = self._kv.list(ts.KvStore.KeyRange(prefix, prefix[:-1] + chr(ord(prefix[-1]) + 1))
                                   if prefix else ts.KvStore.KeyRange())
            keys = future.result(timeout=timeout)
        except TimeoutError as e:
            if future.done():
                raise self._error(what, e) from None
            future.cancel()  # stops its requests, and the keys it gathered are freed
            raise CheckpointingError(f"checkpoint {self.url}: {what} failed: "
                                     f"{unended_listing(self.options, timeout)}") from None
        except Exception as e:
            raise self._error(what, e) from None
        return sorted(k.decode() if isinstance(k, bytes) else k for k in keys)

    def delete(self, name: str) -> None:
        """Delete the object ``name`` (nothing when it is missing)."""
        self._key(name)
        self._wait(self._kv.delete_range(ts.KvStore.KeyRange(name, name + "\0")), f"deleting {name}")

    def delete_keys(self, names: List[str]) -> None:
        """Delete exactly the objects ``names`` (all requests issued, then each awaited): an object
        put under the same prefix since they were listed stays. Each name is checked before any
        request (:meth:`_key`): a listed key may be anyone's."""
        pending = []
        for name in [self._key(n) for n in names]:
            try:
                pending.append((name, self._kv.delete_range(ts.KvStore.KeyRange(name, name + "\0"))))
            except Exception as e:
                raise self._error(f"deleting {name}", e) from None
        for name, future in pending:
            try:
                future.result()
            except Exception as e:
                raise self._error(f"deleting {name}", e) from None


def version_token() -> str:
    """A version's token: the start time (8 hex digits of Unix seconds) and 4 random hex digits: an
    object listing through the kvstore carries no modification times, and ``clean`` must tell a
    version a running save is writing (recent) from one a killed save left behind (old)."""
    return f"{int(time.time()):08x}{secrets.token_hex(2)}"


def new_version(target: str, options: StorageOptions) -> str:
    """A fresh version location under ``target``, claimed for one save (rank 0, before any rank
    writes). Two saves naming a version in the same second share its name once in 65,536 (and a
    killed or committed save's version may hold it): writing into one version, they would mix their
    stores, and a failed one's discard would delete the other's. So a name is taken only when
    nothing is under it, then claimed with an object of a random name (under ``data/rank_00000/``:
    a name a save writes) and listed again: a version holding any other object is left to whoever
    wrote it, and another name tried. Of two saves claiming one name at once, each lists after its
    own claim, so the later one sees the other's claim at least (S3 lists what was written)."""
    store = ObjectStore(target, options)
    for _ in range(_NAME_ATTEMPTS):
        name = VERSION_PREFIX + version_token()
        if store.list_keys(name + "/"):
            continue
        claim = f"{name}/{_CLAIM}{secrets.token_hex(8)}"
        store.write(claim, b"")
        if store.list_keys(name + "/") == [claim]:
            return f"{target}/{name}"
        store.delete(claim)
    raise CheckpointingError(f"checkpoint {store.url}: no free version name after {_NAME_ATTEMPTS} attempts (each "
                             f"was taken by another save meanwhile)")


def version_started(name: str) -> Optional[float]:
    """When the save writing version ``name`` started (Unix seconds), None when its token carries
    no plausible time (a version written before tokens carried one)."""
    if not _VERSION.match(name):
        return None
    started = int(name[len(VERSION_PREFIX):][:8], 16)
    return float(started) if 1_500_000_000 <= started <= time.time() + 86400 else None


def _split(version_url: str) -> Tuple[str, str]:
    """``(target, version name)`` of a version location made by :func:`new_version`."""
    target, _, name = version_url.rpartition("/")
    return target, name


def read_marker(store: ObjectStore) -> Optional[Dict[str, Any]]:
    """The parsed commit marker at ``store``'s location, None when there is none; FormatError when
    it is not a marker of ours (its fields and the version it names checked)."""
    raw = store.read(COMMIT_MARKER)
    if raw is None:
        return None
    where = f"checkpoint {store.url}: {COMMIT_MARKER}"
    marker = parse_marker(raw, where)
    if not isinstance(marker.get("version"), str) or not _VERSION.match(marker["version"]):
        raise FormatError(f"{where}: field 'version' must name a version ('v-' and 12 hex digits), "
                          f"got {str(marker.get('version'))[:40]!r}")
    return marker


def check_target(target: str, options: StorageOptions) -> None:
    """Before a save writes: the location is one a save may own (:func:`_check_location`), the
    bucket answers, and the marker there (if any) is one of ours (a save never replaces another
    tool's ``COMMITTED`` object)."""
    _check_location(target)
    store = ObjectStore(target, options)
    store.check_bucket()
    try:
        read_marker(store)
    except FormatError as e:
        raise CheckpointingError(f"{e}; refusing to replace it (save elsewhere)") from None


def _check_location(target: str) -> None:
    """ArgumentError for a save target that readers take for another checkpoint, or that lies inside a
    checkpoint's version (whose overwrite, removal or ``clean`` deletes what is there: a version's
    ``data/rank_NNNNN/`` holds only what its save wrote)."""
    loc = parse_s3_url(target)
    parts = loc.prefix.split("/") if loc.prefix else []
    if parts and parts[-1] == COMMIT_MARKER:
        raise ArgumentError(f"checkpoint {loc.url}: a location named {COMMIT_MARKER} is read as the checkpoint whose "
                            f"commit marker it is ({checkpoint_url(loc.url)}); save elsewhere")
    version = next((p for p in parts if _VERSION.match(p)), None)
    if version is not None:
        raise ArgumentError(f"checkpoint {loc.url}: {version!r} is named as a checkpoint's version ('v-' and 12 hex "
                            f"digits), whose objects are that checkpoint's to delete; save elsewhere")


def write_object(version_url: str, name: str, data: bytes, options: StorageOptions) -> None:
    """Write one whole object (``common.pt``) of a version."""
    ObjectStore(version_url, options).write(name, data)


def commit(version_url: str, metadata_json: str, marker_json: str, options: StorageOptions) -> None:
    """Rank 0: write ``metadata.json`` into the version, then the marker naming it (with the
    SHA-256 of metadata.json and of common.pt as read back), then delete the previous version."""
    target, name = _split(version_url)
    version = ObjectStore(version_url, options)
    metadata = metadata_json.encode()
    version.write(METADATA_FILE, metadata)
    common = version.read(COMMON_FILE, _OWN_FILE)  # this save's own: read whatever its size
    if common is None:
        raise CheckpointingError(f"checkpoint {version_url}: {COMMON_FILE} is missing; nothing was committed")
    store = ObjectStore(target, options)
    previous = read_marker(store)
    marker = json.loads(marker_json)
    marker.update(version=name, metadata_sha256=sha256_hex(metadata), common_sha256=sha256_hex(common))
    store.write(COMMIT_MARKER, json.dumps(marker).encode())
    if previous is not None and previous["version"] != name:
        try:
            odd = delete_version(store, previous["version"])
            if odd is not None:
                logger.warning("%s/%s: the previous version is left in place (holds %r, which no save of ours "
                               "writes)", store.url, previous["version"], odd)
        except CheckpointingError as e:
            logger.warning("%s (the previous version is left behind; `clean` removes it)", e)


def delete_version(store: ObjectStore, name: str) -> Optional[str]:
    """Delete the objects of version ``name`` at ``store``'s location, as listed now, when each is
    a name a save writes; else nothing, and the first other name (an object not ours stays)."""
    inner = [k[len(name) + 1:] for k in store.list_keys(name + "/")]
    odd = next((k for k in inner if not is_ours(k)), None)
    if odd is None:
        store.delete_keys([f"{name}/{k}" for k in inner])  # what was checked, not what came since
    return odd


def discard(version_url: str, options: StorageOptions) -> None:
    """Remove an uncommitted version's objects (after a failed save), those with a name a save
    writes (:func:`is_ours`: one put there by anyone else stays); failures only logged. A version the
    marker names is kept: a save interrupted (Ctrl-C) in its commit after the marker's PUT, while it
    deleted the previous version, discarded its own committed version, so the marker named nothing."""
    target, name = _split(version_url)
    try:
        store = ObjectStore(target, options)
        marker = read_marker(store)
        if marker is not None and marker["version"] == name:
            return
        inner = [k[len(name) + 1:] for k in store.list_keys(name + "/")]
        store.delete_keys([f"{name}/{k}" for k in inner if is_ours(k)])
    except CheckpointingError as e:
        logger.warning("%s (the uncommitted version is left behind; `clean` removes it)", e)
        return
    odd = [k for k in inner if not is_ours(k)]
    if odd:
        logger.warning("%s: %d object(s) left in place, which no save of ours writes (%r, ...)", version_url,
                       len(odd), odd[0])


def checkpoint_url(url: str) -> str:
    """The checkpoint ``url`` names: itself, or, for the URL of a commit marker, the checkpoint it
    commits (Lightning's ``ckpt_path="last"`` resolves to the marker, the one object of a checkpoint
    with a modification time: see ``lightning/model_checkpoint.py``)."""
    head, _, last = parse_s3_url(url).url.rpartition("/")
    return head if last == COMMIT_MARKER else parse_s3_url(url).url


def open_metadata(url: str, options: StorageOptions) -> MetadataFile:
    """The checked metadata of the committed checkpoint at ``url`` (or the one whose marker ``url``
    names); its ``path`` is the committed version's location (every later read goes there). An
    overwrite committing between the marker's read and the metadata's deletes the version just named:
    the newer one is opened then (a reader polling a training run's checkpoint meets this)."""
    store = ObjectStore(checkpoint_url(url), options)
    for _ in range(_OPEN_ATTEMPTS):
        try:
            marker = read_marker(store)
        except FormatError:
            store.check_bucket()  # an endpoint that is no S3 server (a web page as COMMITTED) is said as such
            raise
        if marker is None:
            store.check_bucket()  # a missing bucket is said as such, not as a missing checkpoint
            raise IncompleteCheckpointError(f"checkpoint {store.url}: no commit marker ({COMMIT_MARKER}): "
                                            f"{what_is_there(store)}")
        path = f"{store.url}/{marker['version']}"
        raw = ObjectStore(path, options).read(METADATA_FILE)
        if raw is not None:
            return MetadataFile(path, check_metadata(raw, marker, path, options.verify), marker)
        now = read_marker(store)
        if now is not None and now["version"] == marker["version"]:
            raise FormatError(f"checkpoint {store.url}: {COMMIT_MARKER} names version {marker['version']}, which "
                              f"has no {METADATA_FILE} (deleted or damaged)")
    raise CheckpointingError(f"checkpoint {store.url}: replaced by {_OPEN_ATTEMPTS} newer saves while being opened "
                             f"(each deleted the version just named); load it again")


def is_committed_version(version_url: str, options: StorageOptions) -> bool:
    """The marker still names ``version_url`` (False once a newer save replaced it); asked after a
    read failed, to tell a replaced checkpoint from damage (versions are never rewritten in place,
    so reads that succeed need no check)."""
    target, name = _split(version_url)
    try:
        marker = read_marker(ObjectStore(target, options))
    except CheckpointingError:
        return True  # cannot tell: the read's own error stands
    return marker is not None and marker["version"] == name


def read_object(version_url: str, name: str, options: StorageOptions) -> Optional[bytes]:
    """One whole object of a committed version (``common.pt``), None when missing."""
    return ObjectStore(version_url, options).read(name)
