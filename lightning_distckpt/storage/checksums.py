"""Checksums of everything a checkpoint stores (format 3), and the switch that turns their checks off.

* array chunks: each chunk's CRC-32C, kept in its array's ``zarr.json`` (format 5, computed by
  us: :mod:`~lightning_distckpt.storage.chunk_checksums`) or appended by the zarr v3 ``crc32c``
  codec (formats 3-4, and object-store saves and packs still), verified on every read: by
  :mod:`~lightning_distckpt.storage.direct_read` for chunks read straight into their
  destinations, by ``chunk_checksums.VerifiedReads`` or tensorstore for the rest (a mismatch is a
  read error naming the chunk and, where known, the file);
* ShardedObject elements: stored framed, ``MAGIC | crc32 | length | bytes`` (the CRC started from
  the save's token, format 7: :mod:`.save_token`), verified on read;
* ``common.pt`` and ``metadata.json``: their SHA-256 in the commit marker, verified on every open.

``StorageOptions(verify=False)`` (or ``LIGHTNING_DISTCKPT_VERIFY=0``, an override for the whole
process) skips the checks of objects, ``common.pt``, ``metadata.json`` and the chunk checksums we
compute (e.g. to salvage what still deserializes from a damaged checkpoint);
chunks that tensorstore decodes through the ``crc32c`` codec are still checked by it. Checkpoints of
formats 1 and 2 carry no checksums: they load with one warning per checkpoint and process.
"""

from __future__ import annotations

import hashlib
import logging
import os
import struct
import zlib
from typing import Optional, Set

from ..core.errors import FormatError
from .save_token import object_crc_seed

logger = logging.getLogger(__name__)

VERIFY_ENV = "LIGHTNING_DISTCKPT_VERIFY"
OBJECT_MAGIC = b"LDCKOBJ1"
_HEADER = struct.Struct("<8sIQ")  # magic, crc32 of the payload, payload length
_warned: Set[str] = set()


def verification_enabled(verify: bool = True) -> bool:
    """``verify`` (the caller's ``StorageOptions.verify``), unless ``LIGHTNING_DISTCKPT_VERIFY`` is
    ``0`` / ``false`` / ``no`` / ``off``: the documented override turning checks off process-wide."""
    return verify and os.environ.get(VERIFY_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def check_sha256(data: bytes, expected: object, where: str, verify: bool = True) -> None:
    """FormatError unless ``data`` hashes to ``expected`` (skipped when verification is off)."""
    if not isinstance(expected, str) or len(expected) != 64:
        raise FormatError(f"{where}: the commit marker's checksum is malformed ({expected!r})")
    if verification_enabled(verify) and sha256_hex(data) != expected:
        raise FormatError(f"{where}: checksum mismatch (SHA-256 {sha256_hex(data)[:16]}..., the commit marker "
                          f"records {expected[:16]}...): the file is damaged or was changed after the commit")


def frame_object(blob: bytes, token: Optional[str] = None) -> bytes:
    """``blob`` as stored: a header with its CRC-32 (started from the save's ``token``, format 7:
    :mod:`.save_token`) and length, then the bytes."""
    return _HEADER.pack(OBJECT_MAGIC, zlib.crc32(blob, object_crc_seed(token)), len(blob)) + blob


def unframe_object(stored: bytes, where: str, required: bool, verify: bool = True,
                   token: Optional[str] = None) -> bytes:
    """The bytes of a stored object, its checksum (from the checkpoint's save ``token``) verified.
    Objects of formats 1 and 2 are stored unframed: accepted as they are unless ``required`` (format 3)."""
    if not stored.startswith(OBJECT_MAGIC):
        if required:
            raise FormatError(f"{where}: stored without its checksum header (damaged)")
        return stored
    if len(stored) < _HEADER.size:
        raise FormatError(f"{where}: truncated ({len(stored)} bytes, shorter than its header)")
    _, crc, length = _HEADER.unpack_from(stored)
    payload = stored[_HEADER.size:]
    if len(payload) != length:
        raise FormatError(f"{where}: {len(payload)} bytes stored, its header says {length} (truncated or damaged)")
    seed = object_crc_seed(token)
    if verification_enabled(verify) and zlib.crc32(payload, seed) != crc:
        raise FormatError(f"{where}: checksum mismatch (CRC-32 {zlib.crc32(payload, seed):#010x}, stored {crc:#010x}): "
                          f"damaged, or written by another save (a rank store copied in from another checkpoint)")
    return payload


def warn_no_checksums(checkpoint_dir: str, version: int) -> None:
    """One warning per checkpoint and process: a checkpoint of format 1 or 2 carries no checksums."""
    if checkpoint_dir in _warned:
        return
    _warned.add(checkpoint_dir)
    logger.warning("checkpoint %s: format %d carries no checksums; damaged bytes cannot be detected. Save it "
                   "again (or `lightning-distckpt convert` it) to add them.", checkpoint_dir, version)
