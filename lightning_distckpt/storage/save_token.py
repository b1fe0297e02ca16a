"""What binds a rank store to the save that wrote it (format 7).

Each rank store keeps its own chunk checksums (in its arrays' ``zarr.json``) and its objects' (in
their frames), and ``metadata.json`` describes the stores by layout alone, so a store copied in
from another checkpoint of the same layout (``rsync`` of one rank's directory from another run, a
restore from the wrong backup) passed every check and loaded its values as this checkpoint's. A save
now records one token in ``metadata.json`` (``save_token``) and in every array it writes (the
``zarr.json`` attribute ``lightning_distckpt.save``) and seeds each object's CRC-32 with it; a reader
checks the arrays' against the index's before reading through them, and an object written by another
save fails its checksum.

The token is derived from the name of the staging directory (or object-store version) the save
writes into: rank 0 names it, every rank writes into it (a node-local tier maps the same name into
each node's root), it is unique per save (a random id in it), and no rank has to send anything more.
"""

from __future__ import annotations

import hashlib
import os
import re
import zlib
from typing import Any, Dict, Optional, Tuple

from ..core.errors import FormatError

TOKEN_FIELD = "save_token"  # metadata.json
TOKEN_ATTRIBUTE = "save"  # zarr.json: attributes.lightning_distckpt.save
_TOKEN = re.compile(r"[0-9a-f]{16}\Z")


def save_token(staging: str) -> str:
    """The token of the save writing into ``staging`` (a path or URL: its last component)."""
    name = staging.rstrip("/").rsplit("/", 1)[-1]
    return hashlib.blake2b(name.encode("utf-8", "surrogateescape"), digest_size=8).hexdigest()


def is_token(value: object) -> bool:
    return isinstance(value, str) and _TOKEN.match(value) is not None


def object_crc_seed(token: Optional[str]) -> int:
    """The value an object's CRC-32 starts from: 0 before format 7 (no token)."""
    return 0 if token is None else zlib.crc32(token.encode())


def recorded_token(meta: Dict[str, Any], where: str) -> str:
    """The token a format 7 ``metadata.json`` records; FormatError when it is missing or malformed."""
    token = meta.get(TOKEN_FIELD)
    if not is_token(token):
        raise FormatError(f"{where}: metadata.json field {TOKEN_FIELD} must be 16 hexadecimal digits, got "
                          f"{str(token)[:40]!r}")
    return token


def token_now_at(checkpoint_dir: str) -> Optional[str]:
    """The token of the save whose ``metadata.json`` is at ``checkpoint_dir`` now (a local directory);
    None where there is none or it cannot be read. A reader that finds another token there than its
    index's knows the checkpoint was replaced under it (a save committed to the same path since). Asked
    after each failed read (``validate`` of a damaged checkpoint: one per damaged shard), a file seen
    unchanged (same inode, size and time) is not parsed again."""
    from .layout import METADATA_FILE, parse_json  # layout imports modules that import this one
    from .paths import METADATA_CAP, read_inside

    path = os.path.join(checkpoint_dir, METADATA_FILE)
    try:
        st = os.stat(path)
    except OSError:
        return None
    seen = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    known = _SEEN.get(path)
    if known is not None and known[0] == seen:
        return known[1]
    try:
        meta = parse_json(read_inside(path, METADATA_FILE, max_bytes=METADATA_CAP), path)
    except (OSError, FormatError):
        return None
    token = meta.get(TOKEN_FIELD) if isinstance(meta, dict) else None
    token = token if is_token(token) else None
    if len(_SEEN) >= 64:  # a few checkpoints read at a time: no need to remember more
        _SEEN.clear()
    _SEEN[path] = (seen, token)
    return token


_SEEN: Dict[str, Tuple[Tuple[int, int, int, int], Optional[str]]] = {}  # metadata.json -> (its stat, token)
