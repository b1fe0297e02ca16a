"""The on-disk layout of a checkpoint directory and its ``metadata.json``.

::

    CKPT/
      metadata.json      format name/version, library version, storage options, tensor/object index
      common.pt          common (non-sharded) state, torch.save'd by rank 0, read with weights_only
      data/rank_00000/   rank 0's tensorstore key-value store (OCDBT database, or plain files)
        t/<key>/<i>/       zarr v3 array: stored shard i of tensor <key>
        p/<dtype>/         zarr v3 1-D array: the small shards of this rank of that dtype, one after
                           the other (each shard's ``packed`` element offset is in metadata.json)
        o/<key>/<i>        bytes: ShardedObject element i of <key>, behind a CRC-32 header
      COMMITTED          commit marker (SHA-256 of metadata.json and common.pt), written last;
                         without it the directory is no checkpoint

Keys are percent-encoded into single path components, so no key can leave its folder.
:func:`open_metadata` reads the metadata as data: never through a link, nesting bounded, every
top-level field checked, the marker's checksum verified (checksums: :mod:`.checksums`).
"""

from __future__ import annotations

import hashlib
import math
import os
import re
import stat
from dataclasses import dataclass
from typing import Any, Callable, Dict, Tuple
from urllib.parse import quote

from ..core.shown import shown
from ..core.errors import CheckpointingError, FormatError, IncompleteCheckpointError, ShardingError, not_found
from .checksums import check_sha256, warn_no_checksums
from .inside import inside_hint
from .stock_checkpoints import dcp_hf_shards_hint
# JSON from disk is parsed by json_bounds.parse_json (nesting and memory bounded before parsing); its
# names stay importable from here.
from .json_bounds import (MAX_JSON_DEPTH, PARSE_FLOOR, PARSE_RATIO, JsonShape,  # noqa: F401
                          json_shape as _json_shape, max_depth as _max_depth, parse_json)
from .paths import (MARKER_CAP, METADATA_CAP, PICKLE_CAP, SizeCap, dir_identity, holds_nothing, local_path,
                    open_regular, read_inside, refuse_special)

# The format's name and versions live in core/format_versions.py; FORMAT_VERSION stays importable from
# here for tests/data/formats/build.py, which runs against the old commits where it was defined here.
from ..core.format_versions import (  # noqa: E402,F401
    CHECKSUMS_SINCE, FORMAT_NAME, FORMAT_VERSION, SUPPORTED_FORMAT_VERSIONS)

METADATA_FILE = "metadata.json"
COMMON_FILE = "common.pt"
COMMIT_MARKER = "COMMITTED"
DATA_DIR = "data"
#: The cap on each file of a checkpoint read whole, by name (the caps themselves: storage/paths.py).
FILE_CAPS: Dict[str, SizeCap] = {COMMIT_MARKER: MARKER_CAP, METADATA_FILE: METADATA_CAP, COMMON_FILE: PICKLE_CAP}
_MAX_COMPONENT = 180


def encode_key(key: str) -> str:
    """One safe path component for ``key``: percent-encoded; long keys shortened with a hash."""
    if key in (".", ".."):
        raise ShardingError(f"key {key!r} is not allowed")
    enc = quote(key, safe="")
    if enc.startswith("."):
        enc = "%2E" + enc[1:]
    if len(enc) > _MAX_COMPONENT:
        enc = enc[:120] + "~" + hashlib.sha256(key.encode()).hexdigest()[:32]
    return enc


def rank_dir(checkpoint_dir: str, writer: int) -> str:
    return os.path.join(checkpoint_dir, DATA_DIR, f"rank_{int(writer):05d}")


def tensor_path(key: str, index: int) -> str:
    return f"t/{encode_key(key)}/{int(index)}"


def pack_path(dtype: str) -> str:
    """The pack array of a writer's small shards of ``dtype`` (a name such as ``"bfloat16"``)."""
    return f"p/{dtype}"


def object_path(key: str, index: int) -> str:
    return f"o/{encode_key(key)}/{int(index)}"


def _is_regular_file(path: str) -> bool:
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def is_committed(checkpoint_dir: str) -> bool:
    """The commit marker and ``metadata.json`` are there, as regular files (links do not count)."""
    return _is_regular_file(os.path.join(checkpoint_dir, COMMIT_MARKER)) and _is_regular_file(
        os.path.join(checkpoint_dir, METADATA_FILE))


_RANK_DIR = re.compile(r"rank_[0-9]{5,}")  # ASCII digits: \d matches the digits of every script


def is_rank_dir_name(name: str) -> bool:
    """Whether ``name`` (an entry of ``data/``) is named as a rank's store: ``rank_NNNNN``."""
    return _RANK_DIR.fullmatch(name) is not None


def is_checkpoint_dir(path: str) -> bool:
    """A directory that this library wrote (committed or not), by our own markers only: a commit marker
    of ours (:func:`is_our_marker`), a ``metadata.json`` naming our format, or (a save torn before
    either) nothing but our entries around a ``data/`` of rank stores (:func:`_only_rank_stores`). A file
    merely named ``COMMITTED``, a ``data/rank_00000/`` of a user's files, a folder holding a ``data/``
    folder (checkpoints beside the training data, say) are not: what is ours is removed whole."""
    if is_our_marker(path) or _names_our_format(os.path.join(path, METADATA_FILE)):
        return True
    try:
        top = os.listdir(path)
        return DATA_DIR in top and set(top) <= _OUR_ENTRIES and _only_rank_stores(os.path.join(path, DATA_DIR))
    except OSError:
        return False


#: The fields every commit marker this library wrote holds, from its first version on (later ones added
#: the checksums; a relayout keeps its source's and sets ``committed_unix``; a tier adds its run).
_MARKER_ALWAYS = ("bytes", "world_size", "committed_unix")
#: What a save writes in a checkpoint directory (``.writing``: a staging directory's owner notes).
_OUR_ENTRIES = frozenset({DATA_DIR, COMMON_FILE, METADATA_FILE, COMMIT_MARKER, ".writing"})
#: A rank store's own entries: an OCDBT database's ``manifest.ocdbt`` and ``d/``, the zarr layout's
#: ``t/``, ``p/``, ``o/`` folders; tensorstore writes each file through a ``<name>.__lock`` beside it.
_STORE_DIRS = frozenset({"d", "t", "p", "o"})


def is_our_marker(path: str) -> bool:
    """``path`` holds a commit marker of ours: a regular file ``COMMITTED`` holding a JSON object with
    the fields every version wrote, each of its type (a file a user named so, empty or not, is not)."""
    marker_file = os.path.join(path, COMMIT_MARKER)
    if not _is_regular_file(marker_file):  # a FIFO is never opened
        return False
    try:
        marker = parse_marker(read_inside(marker_file, COMMIT_MARKER, max_bytes=MARKER_CAP), marker_file)
    except (OSError, CheckpointingError):
        return False
    return all(name in marker for name in _MARKER_ALWAYS)


def _only_rank_stores(data: str) -> bool:
    """``data`` is a directory (no link) holding rank stores only (``rank_NNNNN/``, each empty or holding
    only a store's own entries), at least one."""
    if os.path.islink(data) or not os.path.isdir(data):
        return False
    names = os.listdir(data)
    return bool(names) and all(_RANK_DIR.fullmatch(n) and _is_store(os.path.join(data, n)) for n in names)


def _is_store(store: str) -> bool:
    if os.path.islink(store) or not os.path.isdir(store):
        return False
    for name in os.listdir(store):
        mode = os.lstat(os.path.join(store, name)).st_mode
        if not (stat.S_ISDIR(mode) and name in _STORE_DIRS or stat.S_ISREG(mode) and (
                name == "manifest.ocdbt" or name.endswith(".__lock"))):
            return False
    return True


# How every save of ours begins metadata.json (``json.dumps`` of a dict whose first key is "format")
_OUR_HEAD = b'{"format": "' + FORMAT_NAME.encode() + b'", '


def _names_our_format(metadata_file: str) -> bool:
    """``metadata_file`` is a regular file within the index's size cap holding a JSON object whose ``format``
    is ours: known from its first bytes where they are ours as a save writes them, else parsed whole. A save
    over a checkpoint asks this twice (before writing, and at the swap), and a 10,000-tensor checkpoint's
    index is 1.5 MB, 30 ms a parse; an index that begins as ours and is damaged further on is ours too."""
    try:
        fd = open_regular(metadata_file, METADATA_FILE)  # a link, FIFO or device: refused before it is opened
        try:
            METADATA_CAP.check(os.fstat(fd).st_size, metadata_file, METADATA_FILE)
            if os.read(fd, len(_OUR_HEAD)) == _OUR_HEAD:
                return True
        finally:
            os.close(fd)
        meta = parse_json(read_inside(metadata_file, METADATA_FILE, max_bytes=METADATA_CAP), metadata_file)
    except (OSError, FormatError):
        return False
    return isinstance(meta, dict) and meta.get("format") == FORMAT_NAME


def is_our_committed_checkpoint(path: str) -> bool:
    """``path`` holds a committed checkpoint written by this library: its commit marker and
    ``metadata.json`` are regular files (not links) and the metadata names our format. The test a
    save passes before it replaces a directory: anything else there may be a user's files."""
    return is_committed(path) and _names_our_format(os.path.join(path, METADATA_FILE))


@dataclass(frozen=True)
class MetadataFile:
    """A committed checkpoint's ``metadata.json`` and commit marker, read and checked."""

    path: str  # the checkpoint directory's real path (links to it resolved once, when opened)
    meta: Dict[str, Any]
    marker: Dict[str, Any]


def open_metadata(checkpoint_dir: str, verify: bool = True) -> MetadataFile:
    """Read and check a committed checkpoint's metadata (never through a link inside it; its SHA-256
    verified unless ``verify`` is off). A save committing to the same path between the reads of the marker
    and ``metadata.json`` swaps another directory in: the pair is read again, never called damaged."""
    given = os.path.abspath(local_path(checkpoint_dir))
    if not os.path.isdir(given) or holds_nothing(os.path.realpath(given)):  # missing, or an async save's placeholder
        from .commit import recover_interrupted_commit  # commit imports this module

        recover_interrupted_commit(given)  # a commit killed between its two renames: finish it
        if not os.path.isdir(given):
            raise not_found(given)
    path = os.path.realpath(given)
    for _ in range(8):  # read again after each replacement: more in a row is a writer in a loop
        before = dir_identity(path)
        try:
            marker, meta = _read_committed(given, path, verify)
        except (FormatError, IncompleteCheckpointError):
            if dir_identity(path) == before:
                raise
            continue  # replaced meanwhile: read the checkpoint now there
        if dir_identity(path) == before:
            return MetadataFile(path, meta, marker)
    raise CheckpointingError(f"checkpoint {given}: saves to the same path replaced it 8 times while it was opened")


def _read_committed(given: str, path: str, verify: bool) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """The commit marker and the checked ``metadata.json`` at ``path``."""
    if not is_committed(path):
        for name in (COMMIT_MARKER, METADATA_FILE):
            if os.path.lexists(os.path.join(path, name)):  # a link or a FIFO, say: named as such
                refuse_special(os.path.join(path, name), f"checkpoint {path}:")
        from .committed import holding_hint  # committed imports this module

        holding = holding_hint(given)  # names the checkpoints inside: the listing would name them twice
        listed = "" if holding else f" ({_what_is_there(path)})"
        # "is not a distributed checkpoint": Megatron-Core's words, "does not point to a valid checkpoint" Lightning
        # ModelParallelStrategy's, for scrapers of their logs
        what = ("incomplete checkpoint: the save did not finish (no commit marker)" if is_checkpoint_dir(path) else
                f"not a lightning_distckpt checkpoint (no metadata.json / commit marker: the path does not point to a "
                f"valid checkpoint): {given} is not a "
                f"distributed checkpoint{listed}{inside_hint(given)}{holding}{dcp_hf_shards_hint(path)}")
        raise IncompleteCheckpointError(f"checkpoint {given}: {what}")
    raw = {}
    for name in (COMMIT_MARKER, METADATA_FILE):
        try:
            raw[name] = read_inside(os.path.join(path, name), f"checkpoint {path}:", max_bytes=FILE_CAPS[name])
        except OSError as e:
            raise FormatError(f"checkpoint {path}: cannot read {name}: {e.strerror or e}") from None
    marker = parse_marker(raw[COMMIT_MARKER], f"checkpoint {path}: {COMMIT_MARKER}")
    return marker, check_metadata(raw[METADATA_FILE], marker, path, verify)


def found_there(path: str) -> str:
    """What is at ``path`` that is not ours, in a few words, for a refusal to remove it."""
    if not os.path.isdir(path) or os.path.islink(path):
        return "a file"
    if os.path.lexists(os.path.join(path, COMMIT_MARKER)) and not is_our_marker(path):
        return f"its {COMMIT_MARKER} is not a commit marker of ours; {_what_is_there(path)}"
    return _what_is_there(path)


def _what_is_there(path: str) -> str:
    """A directory's content in a few words, for a refusal: empty, or its first entries."""
    try:
        names = sorted(os.listdir(path))
    except OSError:
        return "it cannot be listed"
    if not names:
        return "an empty directory"
    listed = ", ".join(map(shown, names[:5])) + (f", ... ({len(names)} entries)" if len(names) > 5 else "")
    return f"it holds {listed}"  # names are anyone's: escaped, as a Lightning run prints this error


def read_metadata(checkpoint_dir: str) -> Dict[str, Any]:
    """The parsed ``metadata.json`` of a committed checkpoint, its format checked."""
    return open_metadata(checkpoint_dir).meta


def parse_marker(raw: bytes, where: str) -> Dict[str, Any]:
    """A commit marker's bytes as a JSON object, its known fields checked (FormatError naming ``where``)."""
    marker = parse_json(raw, where)
    if not isinstance(marker, dict):
        raise FormatError(f"{where} is not a JSON object")
    _check_fields(marker, _MARKER_FIELDS, where)
    return marker


def check_metadata(raw: bytes, marker: Dict[str, Any], path: str, verify: bool = True) -> Dict[str, Any]:
    """``metadata.json``'s bytes of the checkpoint at ``path`` (committed by ``marker``) parsed and
    checked, whatever store holds them: our format, a supported version, the marker's SHA-256, every
    top-level field, and the checksums a format 3+ marker records."""
    where = f"checkpoint {path}: {METADATA_FILE}"
    meta = parse_json(raw, where)
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_NAME:
        raise FormatError(f"{where} names format {meta.get('format') if isinstance(meta, dict) else None!r}, "
                          f"expected {FORMAT_NAME!r}")
    version = meta.get("format_version")
    if type(version) is not int or version not in SUPPORTED_FORMAT_VERSIONS:
        raise FormatError(f"{where}: format version {version!r} is not supported by this version of "
                          f"lightning_distckpt (supports {list(SUPPORTED_FORMAT_VERSIONS)}); upgrade the library")
    if "metadata_sha256" in marker:  # whatever the version claims: a damaged byte may have changed it
        check_sha256(raw, marker["metadata_sha256"], where, verify)
    _check_fields(meta, _META_FIELDS, where)
    if version < CHECKSUMS_SINCE:
        warn_no_checksums(path, version)
    elif "metadata_sha256" not in marker or "common_sha256" not in marker:
        raise FormatError(f"checkpoint {path}: {COMMIT_MARKER} lacks the checksums a format {version} checkpoint "
                          f"records (damaged)")
    return meta


# Top-level fields: (required, check, what it must be). Their contents (the index, the storage
# section) are checked where they are parsed (CheckpointIndex.from_json, StorageOptions.from_json).
_Check = Tuple[bool, Callable[[Any], bool], str]
_is_count = (lambda v: type(v) is int and 1 <= v <= 1 << 31, "an int in [1, 2**31]")
_is_time = (lambda v: type(v) in (int, float) and math.isfinite(v), "a finite number")
_is_str = (lambda v: isinstance(v, str), "a string")
_is_obj = (lambda v: isinstance(v, dict), "an object")
_META_FIELDS: Dict[str, _Check] = {
    "library_version": (False, *_is_str), "torch_version": (False, *_is_str), "world_size": (False, *_is_count),
    "created_unix": (False, *_is_time), "converted_unix": (False, *_is_time), "storage": (False, *_is_obj),
    "tensors": (True, *_is_obj), "objects": (True, *_is_obj),
}
_MARKER_FIELDS: Dict[str, _Check] = {
    "world_size": (False, *_is_count), "committed_unix": (False, *_is_time),
    "bytes": (False, lambda v: type(v) is int and v >= 0, "a non-negative int"),
    "metadata_sha256": (False, *_is_str), "common_sha256": (False, *_is_str),
}


def _check_fields(data: Dict[str, Any], fields: Dict[str, _Check], where: str) -> None:
    for name, (required, ok, what) in fields.items():
        if name not in data:
            if required:
                raise FormatError(f"{where}: field {name!r} is missing")
        elif not ok(data[name]):
            raise FormatError(f"{where}: field {name!r} must be {what}, got {_short(data[name])}")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
