"""A checkpoint store in this process's memory (``memory://NAME``): the proof that a store plugs in
as one class and one registration (``register_store``), with nothing else changing.

Blobs (``common.pt``, ``metadata.json``, the commit marker) live in a dict; shards and objects in
tensorstore's ``memory`` kvstore, shared by every reader and writer through one context. A save
writes a fresh version ``memory://NAME/v-<hex>``; the commit writes the marker naming it (one dict
assignment: atomic) and drops the previous version. Leftovers are versions no marker names.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import tensorstore as ts

from lightning_distckpt.core.errors import ArgumentError, IncompleteCheckpointError
from lightning_distckpt.storage.checksums import sha256_hex
from lightning_distckpt.storage.layout import (COMMIT_MARKER, COMMON_FILE, DATA_DIR, METADATA_FILE, MetadataFile,
                                               check_metadata, parse_marker)
from lightning_distckpt.storage.options import StorageOptions
from lightning_distckpt.storage.store import CheckpointStore, StorageFacts, WriterStore

_CONTEXT = ts.Context()  # holds the one memory kvstore every reader and writer of this process shares
_BLOBS: Dict[str, bytes] = {}  # "memory://NAME/v-<hex>/common.pt" -> bytes; "memory://NAME/COMMITTED" -> marker
_STARTED: Dict[str, float] = {}  # version -> when its save began (leftovers' age)


@dataclass(frozen=True)
class MemoryLeftover:
    """A version no marker names."""

    path: str
    target: str
    idle_s: float
    nbytes: Optional[int] = None
    committed: bool = False

    def verdict(self, older_than_s: float) -> str:
        return "recent" if self.idle_s < older_than_s else "remove"

    def reason(self, verdict: str, older_than_s: float) -> str:
        return f"uncommitted, started {self.idle_s:.0f} s ago"


def _kv() -> Any:
    return ts.KvStore.open({"driver": "memory"}, context=_CONTEXT).result()


def _key(path: str) -> str:
    return path[len(MemoryStore.scheme):]


class MemoryStore(CheckpointStore):
    """``memory://NAME``: checkpoints that live as long as this process."""

    scheme = "memory://"

    @classmethod
    def normalize(cls, text: str, what: str) -> str:
        name = text[len(cls.scheme):].strip("/")
        if not name:
            raise ArgumentError(f"{what} {text}: no name after {cls.scheme}")
        return cls.scheme + name

    def _delete(self, prefix: str) -> None:
        for name in [k for k in _BLOBS if k.startswith(prefix + "/")]:
            del _BLOBS[name]
        start = _key(prefix) + "/"
        _kv().delete_range(ts.KvStore.KeyRange(start, start[:-1] + "0")).result()  # "0" follows "/"
        _STARTED.pop(prefix, None)

    def _marker(self) -> Optional[Dict[str, Any]]:
        raw = _BLOBS.get(f"{self.location}/{COMMIT_MARKER}")
        return None if raw is None else parse_marker(raw, f"checkpoint {self.location}: {COMMIT_MARKER}")

    # -- saving
    def check_target(self) -> None:
        self._marker()  # a damaged marker is refused before anything is written

    def new_staging(self) -> str:
        staging = f"{self.location}/v-{uuid.uuid4().hex[:12]}"
        _STARTED[staging] = time.monotonic()  # ages never go negative when the wall clock is set back
        return staging

    def write_blob(self, staging: str, name: str, data: bytes) -> None:
        _BLOBS[f"{staging}/{name}"] = bytes(data)

    def commit(self, staging: str, metadata_json: str, marker: Dict[str, Any]) -> None:
        metadata = metadata_json.encode()
        _BLOBS[f"{staging}/{METADATA_FILE}"] = metadata
        previous = self._marker()
        marker = dict(marker, version=staging.rsplit("/", 1)[1], metadata_sha256=sha256_hex(metadata),
                      common_sha256=sha256_hex(_BLOBS[f"{staging}/{COMMON_FILE}"]))
        _BLOBS[f"{self.location}/{COMMIT_MARKER}"] = json.dumps(marker).encode()
        _STARTED.pop(staging, None)
        if previous is not None and previous["version"] != marker["version"]:
            self._delete(f"{self.location}/{previous['version']}")

    def discard(self, staging: str) -> None:
        self._delete(staging)

    # -- reading
    def open_metadata(self) -> MetadataFile:
        marker = self._marker()
        if marker is None:
            raise IncompleteCheckpointError(f"checkpoint {self.location}: no commit marker")
        path = f"{self.location}/{marker['version']}"
        raw = _BLOBS.get(f"{path}/{METADATA_FILE}")
        if raw is None:
            raise IncompleteCheckpointError(f"checkpoint {path}: no {METADATA_FILE}")
        return MetadataFile(path, check_metadata(raw, marker, path, self.options.verify), marker)

    def read_blob(self, path: str, name: str) -> Optional[bytes]:
        return _BLOBS.get(f"{path}/{name}")

    def _keys(self, prefix: str) -> List[bytes]:
        start = _key(prefix)
        return list(_kv().list(ts.KvStore.KeyRange(start, start[:-1] + chr(ord(start[-1]) + 1))).result())

    def writer_store(self, path: str, writer: int) -> WriterStore:
        return WriterStore(bool(self._keys(f"{path}/{DATA_DIR}/rank_{writer:05d}/")), None)

    def facts(self, path: str) -> StorageFacts:
        common = _BLOBS.get(f"{path}/{COMMON_FILE}")
        leftovers = [{"path": lo.path, "bytes": None, "idle_s": round(lo.idle_s, 1), "in_progress": None}
                     for lo in self.find_leftovers()]
        return StorageFacts(len(self._keys(f"{path}/{DATA_DIR}/")), None, None if common is None else len(common),
                            leftovers)

    # -- tensorstore
    def kvstore_spec(self, path: str) -> Dict[str, Any]:
        return {"driver": "memory", "path": _key(path) + "/"}

    def ts_context(self, options: StorageOptions) -> ts.Context:
        # the executor is _CONTEXT's (tensorstore's default), kept for the process: a context's own is freed racily
        # (lightning_distckpt/storage/ts_context.py)
        return ts.Context({"cache_pool": {"total_bytes_limit": 0}}, parent=_CONTEXT)

    # -- versions
    def exists(self) -> bool:
        return self._marker() is not None

    def remove(self) -> bool:
        if not self.exists():
            return False
        del _BLOBS[f"{self.location}/{COMMIT_MARKER}"]
        self._delete(self.location)
        return True

    def find_leftovers(self) -> List[MemoryLeftover]:
        marker = self._marker() if self.exists() else None
        committed = None if marker is None else f"{self.location}/{marker['version']}"
        now = time.monotonic()
        return sorted((MemoryLeftover(v, self.location, now - t) for v, t in _STARTED.items()
                       if v.startswith(self.location + "/") and v != committed), key=lambda lo: -lo.idle_s)

    def remove_leftover(self, leftover: Any, progress: Any = None) -> None:
        self._delete(leftover.path)
