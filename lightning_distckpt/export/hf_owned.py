"""Which files in a Hugging Face model directory an export may replace or delete: only its own.

An export into an existing directory (another model's ``save_pretrained`` output, a directory
holding config and tokenizer files) must not replace or delete that model's weights. What this
library wrote is marked:

* each safetensors file it writes carries ``{"format": "pt", "written_by": "lightning_distckpt"}``
  in its header's ``__metadata__`` (``format`` is what transformers checks; extra keys are allowed);
* the index it writes carries ``"written_by": "lightning_distckpt"`` in its ``metadata`` next to
  ``total_size`` (transformers and huggingface_hub read only ``total_size`` and ``weight_map``).

A file is ours when our marked index lists it, or when its own header carries the mark (a single
``model.safetensors``, or the files of an export interrupted before its index). :func:`plan_replace`
names every existing file in the way of the new export that is not ours as an ArgumentError (never
deleted), and returns our files of the earlier export that the new one leaves stale.
"""

from __future__ import annotations

import json
import os
import re
import stat
import struct
from typing import Any, Collection, Dict, Optional, Set

from ..core.errors import ArgumentError, ArgumentTypeError, FormatError
from ..storage.json_bounds import parse_json

SINGLE_FILE = "model.safetensors"
CONFIG_FILE = "config.json"  # export_safetensors(config=...): the model's Hugging Face config, copied
INDEX_FILE = "model.safetensors.index.json"
MARK_KEY, MARK = "written_by", "lightning_distckpt"
FILE_METADATA = {"format": "pt", MARK_KEY: MARK}
SHARD_NAME = re.compile(r"model-[0-9]{5}-of-[0-9]{5}\.safetensors")
# Headers and indexes are read to find the mark only; larger ones are not ours (ours are small).
_MAX_JSON_BYTES = 100 << 20


def _read_regular(path: str, limit: int, header: bool) -> Optional[bytes]:
    """The bytes of the regular file ``path`` (not through a link): the whole file, or with
    ``header`` a safetensors header; None when it is anything else or larger than ``limit``."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        return None
    if not stat.S_ISREG(os.fstat(fd).st_mode):  # before fdopen, which raises IsADirectoryError on a directory
        os.close(fd)
        return None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not header:
            return f.read(limit + 1) if st.st_size <= limit else None
        head = f.read(8)
        if len(head) < 8:
            return None
        (n,) = struct.unpack("<Q", head)
        return f.read(n) if n <= min(limit, st.st_size - 8) else None


def _json(raw: Optional[bytes]) -> Any:
    """``raw`` parsed; None when it is no JSON (not ours), nested too deep (``json.loads`` raised
    RecursionError) or would parse into far more memory than its size (storage/json_bounds.py)."""
    try:
        return None if raw is None else parse_json(raw, "export target")
    except FormatError:
        return None


def file_is_ours(path: str) -> bool:
    """The safetensors file ``path`` carries our mark in its header's ``__metadata__``."""
    header = _json(_read_regular(path, _MAX_JSON_BYTES, header=True))
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    return isinstance(meta, dict) and meta.get(MARK_KEY) == MARK


def index_files(out_dir: str) -> Optional[Set[str]]:
    """The shard file names our marked index in ``out_dir`` lists; None when there is no index or
    it is not ours (then it is in the way)."""
    index = _json(_read_regular(os.path.join(out_dir, INDEX_FILE), _MAX_JSON_BYTES, header=False))
    if not isinstance(index, dict) or not isinstance(index.get("metadata"), dict):
        return None
    if index["metadata"].get(MARK_KEY) != MARK or not isinstance(index.get("weight_map"), dict):
        return None
    return {n for n in index["weight_map"].values() if isinstance(n, str) and SHARD_NAME.fullmatch(n)}


def index_json(total_size: int, weight_map: Dict[str, str]) -> str:
    """The text of our index: Hugging Face's fields plus our mark."""
    index = {"metadata": {"total_size": total_size, MARK_KEY: MARK}, "weight_map": weight_map}
    return json.dumps(index, indent=2, sort_keys=True) + "\n"


def read_config(config: Any, out_dir: str) -> bytes:
    """The bytes of the Hugging Face config file ``config`` (a path) to copy into ``out_dir`` as
    ``config.json``: a JSON object (ArgumentError otherwise). A ``config.json`` already in
    ``out_dir`` is replaced only by the same bytes: a different one (another model's) is an
    ArgumentError naming both, before anything is written."""
    if not isinstance(config, (str, os.PathLike)):
        raise ArgumentTypeError(f"config must be the path of a config.json, got {type(config).__name__}")
    path = os.fspath(config)
    raw = _read_regular(path, _MAX_JSON_BYTES, header=False) if os.path.exists(path) else None
    if raw is None:
        raise ArgumentError(f"config {path}: no such file, not a regular file, or larger than {_MAX_JSON_BYTES} bytes")
    if not isinstance(_json(raw), dict):
        raise ArgumentError(f"config {path}: not a JSON object (a Hugging Face config.json, e.g. from "
                            f"AutoConfig.save_pretrained)")
    existing = os.path.join(out_dir, CONFIG_FILE)
    if os.path.lexists(existing) and _read_regular(existing, _MAX_JSON_BYTES, header=False) != raw:
        raise ArgumentError(f"export destination {out_dir}: {existing} exists and differs from {path}; refusing to "
                            f"replace it: remove it, or leave out config")
    return raw


def plan_replace(out_dir: str, names: Collection[str]) -> Set[str]:
    """Check that the export of the files ``names`` into ``out_dir`` replaces only our files;
    return our files there that it leaves stale (to delete once its index is written).

    In the way, and an ArgumentError naming them when not ours: each of ``names`` that exists, an
    index (readers would follow it) and a ``model.safetensors`` (transformers prefers it to an
    index). Other files (config, tokenizer, another model's unindexed shards) are left alone."""
    if not os.path.lexists(out_dir):
        return set()
    if os.path.islink(out_dir) or not os.path.isdir(out_dir):
        raise ArgumentError(f"export destination {out_dir}: exists and is not a directory")
    present = set(os.listdir(out_dir))
    listed = index_files(out_dir) if INDEX_FILE in present else set()

    def ours(name: str) -> bool:
        if name == INDEX_FILE:
            return listed is not None
        return name in (listed or set()) or file_is_ours(os.path.join(out_dir, name))

    foreign = sorted(n for n in present & (set(names) | {INDEX_FILE, SINGLE_FILE}) if not ours(n))
    if foreign:
        shown = ", ".join(os.path.join(out_dir, n) for n in foreign)
        raise ArgumentError(
            f"export destination {out_dir}: {shown} exist(s) and were not written by lightning_distckpt (another "
            f"model's weights?); refusing to replace or delete them: export into another directory, or move them")
    stale = {n for n in present - set(names) if (SHARD_NAME.fullmatch(n) or n == SINGLE_FILE) and ours(n)}
    if INDEX_FILE in present and INDEX_FILE not in names:
        stale.add(INDEX_FILE)
    return stale
