"""Checkpoints in S3-compatible object storage (``s3://bucket/prefix``): a save writes a fresh
version, rank 0 commits it with one marker PUT (:mod:`.s3`); leftovers are the versions no marker
names (:mod:`.s3_versions`). Everything goes through tensorstore's ``s3`` kvstore (:mod:`.s3_url`)."""

from __future__ import annotations

import json
import re
from typing import Any, Dict, List, Optional

import tensorstore as ts

from ..core.errors import CheckpointingError
from ..progress import Progress
from . import s3, s3_live, s3_versions
from .layout import COMMIT_MARKER, COMMON_FILE, DATA_DIR, MetadataFile, rank_dir
from .integrity import store_file_cap
from .options import StorageOptions
from .s3_reads import first_larger
from .s3_url import S3_READ_COALESCING, S3_SCHEME, context_spec, explain_io, kvstore_spec, parse_s3_url
from .store import CheckpointStore, StorageFacts, WriterStore
from .ts_context import child_context


class S3Store(CheckpointStore):
    """An ``s3://`` location: a checkpoint (its marker and versions) or a prefix holding several."""

    scheme = S3_SCHEME
    ocdbt_options = S3_READ_COALESCING

    @classmethod
    def normalize(cls, text: str, what: str) -> str:
        return parse_s3_url(text).url

    # -- saving -------------------------------------------------------------------------
    def check_target(self) -> None:
        s3.check_target(self.location, self.options)

    def new_staging(self) -> str:
        """A fresh version, marked live until its commit or discard (:mod:`.s3_live`): a save running longer
        than ``clean``'s bound is not taken for a leftover."""
        version = s3.new_version(self.location, self.options)
        try:
            self._keepers[version] = s3_live.keep_alive(version, self.options, self)
        except BaseException:
            s3.discard(version, self.options)  # its claim
            raise
        return version

    @property
    def _keepers(self) -> Dict[str, Any]:
        """version URL -> the keeper marking it live, for the versions this store named (a copy made by
        ``with_options`` shares them: it is the same save's store)."""
        return self.__dict__.setdefault("_live_versions", {})

    def _stop_keeping(self, staging: str) -> None:
        keeper = self._keepers.pop(staging, None)
        if keeper is not None:
            keeper.stop()

    def write_blob(self, staging: str, name: str, data: bytes) -> None:
        s3.write_object(staging, name, data, self.options)

    def commit(self, staging: str, metadata_json: str, marker: Dict[str, Any]) -> None:
        """Never a marker naming a version some of whose objects were deleted while the save ran
        (:func:`.s3_live.check_complete`); the liveness marks stop once the marker is written (or not)."""
        try:
            s3_live.check_complete(staging, metadata_json, self.options)
            s3.commit(staging, metadata_json, json.dumps({k: v for k, v in marker.items() if k != "version"}),
                      self.options)
        finally:
            self._stop_keeping(staging)

    def discard(self, staging: str) -> None:
        self._stop_keeping(staging)  # first: no mark lands after the discard listed the version
        s3.discard(staging, self.options)

    # -- reading ------------------------------------------------------------------------
    def open_metadata(self) -> MetadataFile:
        return s3.open_metadata(self.location, self.options)

    def read_blob(self, path: str, name: str) -> Optional[bytes]:
        """None when missing from the committed version; when an overwrite deleted it (the marker
        names another version now), a CheckpointingError saying so, not that the object is missing."""
        blob = s3.read_object(path, name, self.options)
        if blob is None and not s3.is_committed_version(path, self.options):
            raise CheckpointingError(f"checkpoint {path} was replaced while being read (a newer save committed to "
                                     f"the same path and deleted its {name}); load it again")
        return blob

    def writer_store(self, path: str, writer: int) -> WriterStore:
        """Whether any object is under the writer's prefix (an object store has no links, and its
        sizes are not listed through the kvstore)."""
        keys = s3.ObjectStore(path, self.options).list_keys(f"{DATA_DIR}/rank_{int(writer):05d}/")
        return WriterStore(bool(keys), None, f"no objects under {rank_dir(path, writer)}")

    def check_writer(self, path: str, writer: int, claimed_bytes: int) -> None:
        """Before a reader opens ``writer``'s store: no object that tensorstore reads whole (an OCDBT
        manifest, a zarr chunk) larger than the cap a store file of that name has
        (:func:`.integrity.store_file_cap`, as a directory's files): a hostile one of gigabytes would
        otherwise be fetched whole into memory. One listing and one byte past each cap read (a zarr.json
        and an object are read bounded where they are read: ``array_metadata.py``)."""
        store = s3.ObjectStore(rank_dir(path, writer), self.options)
        caps = {rel: capped for rel in store.list_keys()
                if not rel.endswith("zarr.json") and not rel.startswith("o/")
                and (capped := store_file_cap(rel, claimed_bytes)) is not None}
        over = first_larger(store, {rel: cap.limit() for rel, (cap, _) in caps.items()})
        if over is not None:
            cap, said = caps[over]
            raise cap.refusal(f"checkpoint {path}: store of rank {writer}{said} {store.url}/{over}", None,
                              cap.limit())

    def still_committed(self, path: str) -> bool:
        return s3.is_committed_version(path, self.options)

    def facts(self, path: str) -> StorageFacts:
        """Objects under data/ (their sizes are not listed), common.pt's size (found with ranged reads
        of at most 1 MiB: ``inspect`` shows it, and must not fetch a common state of gigabytes for it),
        and the versions no marker names."""
        version = s3.ObjectStore(path, self.options)
        common = version.size(COMMON_FILE, 1 << 62)  # its true size, past a load's cap too
        target = path.rpartition("/")[0]
        leftovers = [{"path": lo.path, "bytes": None, "idle_s": None if lo.idle_s is None else round(lo.idle_s, 1),
                      "in_progress": None}
                     for lo in s3_versions.find_s3_leftovers(target, self.options) if lo.target == target]
        return StorageFacts(len(version.list_keys(DATA_DIR + "/")), None, common,
                            leftovers)

    # -- tensorstore ----------------------------------------------------------------------
    def kvstore_spec(self, path: str) -> Dict[str, Any]:
        return kvstore_spec(path, self.options)

    def ts_context(self, options: StorageOptions) -> ts.Context:
        return child_context(context_spec(options))

    def said(self, error: BaseException) -> str:
        """A failed request of tensorstore's (a chunk's read, an OCDBT node's write) in our words, naming the
        object and the endpoint, before curl's or the server's (:func:`.s3_url.explain_io`)."""
        return explain_io(error, self.options, parse_s3_url(self.location).bucket)

    # -- versions ---------------------------------------------------------------------------
    def exists(self) -> bool:
        return s3.read_marker(s3.ObjectStore(s3.checkpoint_url(self.location), self.options)) is not None

    def remove(self) -> bool:
        return s3_versions.remove_checkpoint(self.location, self.options)

    def find_leftovers(self) -> List[s3_versions.S3Leftover]:
        return s3_versions.find_s3_leftovers(self.location, self.options)

    def remove_leftover(self, leftover: Any, progress: Optional[Progress] = None) -> None:
        s3_versions.remove_version(leftover, self.options)

    def last_checkpoints(self, first: str, matches: "re.Pattern[str]") -> Optional[List[str]]:
        """As the URLs of their commit markers: the one object of a checkpoint with a modification
        time, which Lightning's ``ckpt_path="last"`` compares (``lightning/model_checkpoint.py``)."""
        return [f"{url}/{COMMIT_MARKER}" for url in s3_versions.committed_children(self.location, first, self.options)
                if matches.match(url.rsplit("/", 1)[1])]
