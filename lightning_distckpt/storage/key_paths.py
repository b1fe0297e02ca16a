"""Keys that would share one place on disk.

:func:`~.layout.encode_key` percent-encodes a key into one path component, and shortens an
encoding longer than 180 characters to its first 120, ``~`` and 32 hex digits of the key's
SHA-256. ``quote`` leaves ``~`` as it is, so a shorter key spelled like such a shortened form is
stored where the long key is: two ShardedObjects would both load as one of them, two tensors would
overwrite each other's array. Every other pair of keys has distinct encodings (percent-encoding is
one-to-one, and a leading ``.`` becomes ``%2E``, which ``quote`` never writes), unless two long keys
share their first 120 encoded characters and 128 bits of SHA-256.

Saves refuse such pairs before anything is written (``planning/validation.key_path_problems``) and
loads refuse an index listing them (``CheckpointIndex.from_json``); checkpoints without them, every
one written so far that loads correctly, keep their paths.
"""

from __future__ import annotations

import re
from typing import Collection, List, Tuple

from urllib.parse import quote

from .layout import encode_key

_SHORTENED = re.compile(r".{120}~[0-9a-f]{32}", re.S)  # the form of a shortened encoding
_LONGEST = 180  # longer encodings are shortened (layout._MAX_COMPONENT)


def colliding_keys(keys: Collection[str]) -> List[Tuple[str, str]]:
    """Pairs ``(first, later)`` of ``keys`` (in their order) whose encodings are equal. Cheap when
    no key contains ``~`` (a collision needs a key whose encoding has the shortened form)."""
    if not any("~" in k and _SHORTENED.fullmatch(encode_key(k)) for k in keys):
        return []
    by_path: dict = {}
    pairs = []
    for k in keys:
        first = by_path.setdefault(encode_key(k), k)
        if first != k:
            pairs.append((first, k))
    return pairs


def collision_reason(first: str, later: str) -> str:
    """Why ``first`` and ``later`` are stored at one path, for an error message."""
    short = first if len(quote(first, safe="")) <= _LONGEST else later
    return (f"both are stored as {encode_key(first)!r}: a key whose percent-encoding is longer than {_LONGEST} "
            f"characters is stored as its first 120 characters, '~' and a hash of the key, and {short!r} is "
            f"spelled that way")
