"""The names of staging directories (:mod:`.staging`): how a staging name is made beside its target, how one
is recognised, and which checkpoint it was meant to become.

Three forms, all hidden siblings of the target (same file system, so the commit is an atomic rename), each
optionally followed by ``.old<N>`` (a previous checkpoint a commit moved aside) or ``.removed`` (a removal's
aside):

- ``.distckpt-staging-<NAME in base32>-<id>``: names up to 135 bytes. Encoded, not spelled out, because
  Lightning scans checkpoint folders by name: its SLURM requeue resume takes every name holding ``hpc_ckpt_``
  and keeps its digits, so ``.hpc_ckpt_33.ckpt.distckpt-staging-<hex>`` would win as a huge version that does
  not exist.
- ``.NAME.distckpt-staging-<id>``: names of 136-224 bytes (too long to encode), and earlier versions' saves.
- ``.distckpt-staging-sha-<40 hex digits of NAME's SHA-256>-<id>``: names of 225-255 bytes, which fit in no
  name that spells them. The name itself is recorded in each rank's owner note (``.writing/rank_NNNNN.json``,
  field ``target``); :func:`target_of` reads it there, or else finds the entry beside it whose name has that
  hash (a committed checkpoint the staging directory replaces, or moved aside). A directory of this form
  whose notes are gone and whose target is missing (a commit stopped between removing its notes and its
  rename, a first save of that name) has no known target: ``clean`` keeps it when it is committed, and the
  next save or load of its checkpoint, which knows the name, renames it into place (:func:`names_target`).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os
import re
import uuid
from typing import Optional

from ..core.errors import FormatError
from .paths import read_inside

STAGING_TAG = ".distckpt-staging-"
OWNERS_DIR = ".writing"
# A removal's aside name ends so (storage/local_store.py: _remove_dir): a committed checkpoint there is one being
# removed, never a stranded commit to recover, however the removal was interrupted
REMOVAL_SUFFIX = ".removed"
NAME_MAX = 255  # bytes in one file name (ext4, xfs, NFS, Lustre)
_SUFFIX_ROOM = 8  # for what is appended to a staging name: ".old" to ".old7" (commit._SWAP_TRIES) or ".removed"
_MAX_NOTE_BYTES = 1 << 16  # a note is ~100 bytes (~350 with a long target's name): more is not one of ours
_SUFFIX = r"(?:\.old[0-9]*|\.removed)?\Z"
# ".distckpt-staging-<base32 of the target's name>-<12 hex digits>", optionally suffixed
_ENCODED = re.compile(r"\.distckpt-staging-([a-z2-7]+)-[0-9a-f]{12}" + _SUFFIX)
# ".distckpt-staging-sha-<hash of the target's name>-<12 hex digits>", optionally suffixed
_HASH_DIGITS = 40
_HASHED = re.compile(r"\.distckpt-staging-sha-([0-9a-f]{%d})-[0-9a-f]{12}" % _HASH_DIGITS + _SUFFIX)
# Names longer than this (in bytes) get the hashed form: the spelled-out one, with a 4-digit id and room for a
# suffix, would not fit
_HASHED_FROM = NAME_MAX - _SUFFIX_ROOM - len(STAGING_TAG) - 1 - 4


def _encode_name(name: str) -> str:
    """``name`` in lower-case base32 without padding: letters and 2-7 only, so no ``ckpt_``, no
    ``.ckpt`` and no ``last`` prefix that Lightning's folder scans would match."""
    return base64.b32encode(os.fsencode(name)).decode("ascii").rstrip("=").lower()


def _decode_name(text: str) -> Optional[str]:
    """The name :func:`_encode_name` encoded as ``text``; None when ``text`` is not such an encoding
    (or decodes to something that is not one file name)."""
    try:
        name = os.fsdecode(base64.b32decode(text.upper() + "=" * (-len(text) % 8)))
    except (binascii.Error, ValueError):
        return None
    if _encode_name(name) != text or not _one_name(name):
        return None
    return name


def _one_name(name: str) -> bool:
    return name not in ("", ".", "..") and "/" not in name and "\0" not in name


def _name_hash(name: str) -> str:
    """What a staging name of the hashed form holds of its target's ``name``."""
    return hashlib.sha256(os.fsencode(name)).hexdigest()[:_HASH_DIGITS]


def new_staging_dir(target: str) -> str:
    """A fresh staging path beside ``target`` (same file system, so the final rename is atomic), in the form
    the length of the target's name allows (module docstring). Every form leaves room for a suffix
    (``.old<N>``, ``.removed``); the spelled-out form's id is shortened to fit (4 hex digits at least), and a
    name too long for that (225-255 bytes) gets the hashed form, its name recorded in the owner notes
    (:func:`~.staging.write_owner_note`)."""
    parent, name = os.path.split(os.path.abspath(target))
    uid = uuid.uuid4().hex[:12]
    encoded = f"{STAGING_TAG}{_encode_name(name)}-{uid}"
    if len(os.fsencode(encoded)) + _SUFFIX_ROOM <= NAME_MAX:
        return os.path.join(parent, encoded)
    room = NAME_MAX - _SUFFIX_ROOM - len(os.fsencode(f".{name}{STAGING_TAG}"))
    if room >= 4:
        return os.path.join(parent, f".{name}{STAGING_TAG}{uid[:room]}")
    return os.path.join(parent, f"{STAGING_TAG}sha-{_name_hash(name)}-{uid}")


def removal_aside(target: str) -> str:
    """A fresh name beside ``target`` that a removal renames it to before removing it: a staging name
    (``clean`` finds and removes what an interruption left there) ending in :data:`REMOVAL_SUFFIX`."""
    return new_staging_dir(target) + REMOVAL_SUFFIX


def is_removal_aside(path: str) -> bool:
    """A name :func:`removal_aside` made: what is there is being removed, committed or not."""
    return is_staging_dir(path) and os.path.basename(os.path.normpath(path)).endswith(REMOVAL_SUFFIX)


def is_staging_dir(path: str) -> bool:
    """A staging directory's name, in any form (``.distckpt-staging-<base32>-<id>``, the older
    ``.NAME.distckpt-staging-<id>``, ``.distckpt-staging-sha-<hash>-<id>``), with or without a ``.old<N>``
    or ``.removed`` suffix."""
    base = os.path.basename(os.path.normpath(path))
    return base.startswith(".") and STAGING_TAG in base


def names_target(staging: str, name: str) -> bool:
    """The staging directory ``staging`` (any form) was meant to become the entry ``name`` beside it. Needs
    nothing recorded: a hashed form's hash is compared with ``name``'s (a save, a load or a recovery knows
    its target's name even where :func:`target_of` does not)."""
    hashed = _HASHED.match(os.path.basename(os.path.normpath(staging)))
    if hashed:
        return _one_name(name) and _name_hash(name) == hashed.group(1)
    target = target_of(staging)
    return target is not None and os.path.basename(target) == name


def target_of(staging: str) -> Optional[str]:
    """The checkpoint path a staging directory (any form) was meant to become. None only for the hashed form
    when its name is recorded in no owner note and no entry beside it has that name's hash (module
    docstring): its target is then missing, and its name unknown here."""
    parent, base = os.path.split(os.path.normpath(staging))
    hashed = _HASHED.match(base)
    if hashed:
        name = _recorded_name(staging, hashed.group(1)) or _sibling_named(parent, hashed.group(1))
        return None if name is None else os.path.join(parent, name)
    match = _ENCODED.match(base)
    name = _decode_name(match.group(1)) if match else None
    if name is None:  # the older form: the name spelled out before the tag
        name = base[1 : base.rindex(STAGING_TAG)]
    return os.path.join(parent, name)


def _recorded_name(staging: str, digest: str) -> Optional[str]:
    """The target's name an owner note in ``staging`` records, when it has the hash ``digest`` (a note
    naming anything else is not believed). Notes are read without following links or waiting
    (:func:`~.paths.read_inside`)."""
    notes = os.path.join(staging, OWNERS_DIR)
    try:
        names = sorted(os.listdir(notes))
    except OSError:
        return None
    for entry in names:
        try:
            note = read_inside(os.path.join(notes, entry), "owner note", max_bytes=_MAX_NOTE_BYTES)
            name = json.loads(note)["target"]
        except (OSError, ValueError, KeyError, TypeError, RecursionError, FormatError):
            continue  # a half-written note, a note of a save that records no name, or not a note
        if isinstance(name, str) and _one_name(name) and _name_hash(name) == digest:
            return name
    return None


def _sibling_named(parent: str, digest: str) -> Optional[str]:
    """The entry of ``parent`` (not a staging name) whose name has the hash ``digest``: the checkpoint a
    hashed staging directory replaces, or whose previous copy it holds (``.old<N>``)."""
    try:
        names = os.listdir(parent)
    except OSError:
        return None
    return next((n for n in names if len(os.fsencode(n)) > _HASHED_FROM and not is_staging_dir(n)
                 and _name_hash(n) == digest), None)
