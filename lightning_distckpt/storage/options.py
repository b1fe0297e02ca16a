"""How arrays are stored (:class:`StorageOptions`): chosen by whoever saves, partly recorded in
``metadata.json`` and checked as data when read back."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional

from ..core.errors import ConfigError, FormatError

LAYOUTS = ("ocdbt", "zarr")
DEFAULT_CHUNK_BYTES = 64 * 1024 * 1024
DEFAULT_DATA_FILE_BYTES = 64 * 1024 * 1024
DEFAULT_PACK_MAX_BYTES = 256 * 1024
S3_CREDENTIALS = ("environment", "default", "anonymous")
_MAX_CHUNK_BYTES = 1 << 40  # larger chunks are no checkpoint of ours: refuse before sizing anything by them


@dataclass(frozen=True)
class StorageOptions:
    """How arrays are stored.

    layout: ``"ocdbt"`` (default) puts each rank's arrays in one OCDBT database: a handful of
        files per rank whatever the number of tensors. ``"zarr"`` writes plain zarr v3 arrays,
        one directory per stored shard (``zarr.json`` + one file per chunk), readable by any zarr
        v3 tool, but thousands of small files for a real model (see docs/format.md).
    chunk_bytes: largest zarr chunk; bigger shards are split along their first axis, so a
        resharded read fetches only the chunks it overlaps. Recorded in ``metadata.json``.
    io_concurrency: tensorstore's file I/O and copy concurrency (not recorded: a reader's choice).
    data_file_bytes: ``"ocdbt"`` only: target size of each OCDBT data file. Bounded files are
        written concurrently and each in moderate ``writev`` calls; a rank writes about
        ``bytes / data_file_bytes`` + a few files (with ``direct_writes`` on a local disk, one or more
        per 32 MiB part of the write). Not recorded: readers do not need it.
    pack_max_bytes: shards of at most this many bytes (not flattened) are packed into one array
        per writing rank and dtype instead of an array each; 0 packs nothing. Where each shard
        went is recorded per shard in ``metadata.json``.
    s3_endpoint, s3_region, s3_credentials, s3_retries: ``s3://`` checkpoints only (see
        docs/object_storage.md), never recorded. The endpoint and region override
        ``AWS_ENDPOINT_URL`` and ``AWS_REGION``; ``s3_credentials`` is ``"environment"``
        (``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY``), ``"profile:NAME"``, ``"default"``
        (the AWS SDK's chain) or ``"anonymous"``; s3_retries: attempts per request.
    verify: a reader's choice, never recorded: verify the checksums we compute (chunks, objects,
        ``common.pt``, ``metadata.json``) on every read. False only to salvage what still reads
        from a damaged checkpoint; ``LIGHTNING_DISTCKPT_VERIFY=0`` turns it off process-wide.
    direct_reads: a reader's choice, never recorded: read whole chunks of local checkpoints
        straight into their destinations (``storage/direct_read.py``); False sends every read
        through tensorstore (as ``LIGHTNING_DISTCKPT_DIRECT_READS=0`` does process-wide).
    direct_writes: a writer's choice, never recorded: keep a save's bytes out of the page cache
        on a local file system that has one (not tmpfs). In the ``"zarr"`` layout the chunk files of
        arrays of 128 KiB+ are written with ``O_DIRECT`` (``storage/direct_write.py``: the same
        bytes, a fraction of the CPU); in ``"ocdbt"`` a rank's arrays are committed in parts of
        32 MiB, each part's files dropped from the cache once durable (``storage/page_cache.py``:
        the next part reuses the freed pages). False, or ``LIGHTNING_DISTCKPT_DIRECT_WRITES=0``
        process-wide, leaves everything to tensorstore's buffered writes, one commit per write.
    """

    layout: str = "ocdbt"
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    io_concurrency: int = 16
    data_file_bytes: int = DEFAULT_DATA_FILE_BYTES
    pack_max_bytes: int = DEFAULT_PACK_MAX_BYTES
    s3_endpoint: Optional[str] = None
    s3_region: Optional[str] = None
    s3_credentials: Optional[str] = None
    s3_retries: int = 4
    verify: bool = True
    direct_reads: bool = True
    direct_writes: bool = True

    def __post_init__(self) -> None:
        for name in ("verify", "direct_reads", "direct_writes"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be a bool, got {type(getattr(self, name)).__name__}")
        for name in ("chunk_bytes", "io_concurrency", "data_file_bytes", "pack_max_bytes", "s3_retries"):
            value = getattr(self, name)  # a float, str or bool would fail below as a TypeError, or pass
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"{name} must be an int, got {type(value).__name__} {value!r}")
        for name in ("s3_endpoint", "s3_region", "s3_credentials"):
            value = getattr(self, name)  # a number here failed as an AttributeError (str methods below)
            if value is not None and not isinstance(value, str):
                raise ConfigError(f"{name} must be null or a str, got {type(value).__name__} {value!r}")
        if self.layout not in LAYOUTS:
            raise ConfigError(f"unknown storage layout {self.layout!r}; choose one of {LAYOUTS}")
        if not 1024 <= self.chunk_bytes <= _MAX_CHUNK_BYTES:  # readers refuse larger chunks (from_json)
            raise ConfigError(f"chunk_bytes must be in [1024, {_MAX_CHUNK_BYTES}], got {self.chunk_bytes}")
        if self.io_concurrency < 1:
            raise ConfigError(f"io_concurrency must be >= 1, got {self.io_concurrency}")
        if self.data_file_bytes < 1024:
            raise ConfigError(f"data_file_bytes must be at least 1024, got {self.data_file_bytes}")
        if self.pack_max_bytes < 0:
            raise ConfigError(f"pack_max_bytes must be >= 0, got {self.pack_max_bytes}")
        if self.s3_endpoint is not None and not self.s3_endpoint.startswith(("http://", "https://")):
            raise ConfigError(f"s3_endpoint must be an http:// or https:// URL, got {self.s3_endpoint!r}")
        if self.s3_retries < 1:
            raise ConfigError(f"s3_retries must be >= 1, got {self.s3_retries}")
        creds = self.s3_credentials
        if creds is not None and creds not in S3_CREDENTIALS and not creds.startswith("profile:"):
            raise ConfigError(f"s3_credentials must be one of {S3_CREDENTIALS} or 'profile:NAME', got {creds!r}")

    def to_json(self) -> Dict[str, Any]:
        """The fields metadata.json records (``storage``), read back by :meth:`from_json`."""
        return {"layout": self.layout, "chunk_bytes": self.chunk_bytes}

    @classmethod
    def from_json(cls, data: Any, where: str = "metadata.json") -> "StorageOptions":
        """The recorded options of a checkpoint's ``storage`` section (``data``), every field checked
        (FormatError naming it and ``where``, the file: the section comes from disk)."""
        if not isinstance(data, dict):
            raise FormatError(f"{where}: field 'storage' must be an object, got {type(data).__name__}")
        layout = data.get("layout", "ocdbt")
        if layout not in LAYOUTS:
            raise FormatError(f"{where}: field 'storage.layout' must be one of {list(LAYOUTS)}, got {layout!r}")
        chunk = data.get("chunk_bytes", DEFAULT_CHUNK_BYTES)
        if type(chunk) is not int or not 1024 <= chunk <= _MAX_CHUNK_BYTES:
            raise FormatError(f"{where}: field 'storage.chunk_bytes' must be an int in [1024, {_MAX_CHUNK_BYTES}], "
                              f"got {chunk!r}")
        backend = data.get("backend", "tensorstore")
        if backend != "tensorstore":
            raise FormatError(f"{where}: field 'storage.backend' must be 'tensorstore', got {backend!r}")
        return cls(layout=layout, chunk_bytes=chunk)
