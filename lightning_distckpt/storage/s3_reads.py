"""Reading an S3 object in bounded memory through tensorstore's ``s3`` kvstore, which lists no sizes
and reads an object without a byte range whole, however large it is by then.

A size probe followed by a read of the whole object is not bounded: the object may be replaced by a
larger one between the two (its writer is anyone who can write the bucket). So the size is found
with ranged reads of at most :data:`WINDOW` bytes each, and the object is then read with the byte
range ``[0, size)``: a replacement meanwhile yields at most ``size`` bytes (then refused by the
checksum or parser that reads them), never more. tensorstore refuses a ranged read that the object
ends inside, saying ``... and total size N`` (its own message, from the answer's ``Content-Range``):
that is how a window that holds the object's end tells its size.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Dict, Optional, Tuple

from ..core.errors import CheckpointingError
from .kv_probe import ends_before, holds_byte, read_past
from .s3_url import answer_timeout, parse_s3_url

if TYPE_CHECKING:
    from .s3 import ObjectStore

#: The most bytes the first size probe moves (kept: an object smaller than this is read by it), and
#: each later one (a window holding the object's end moves up to it).
WINDOW, _STEP = 1 << 20, 256 << 10
_TOTAL = re.compile(r"and total size (\d+)")
# A size probe's outcome: (lowest, highest) size the object may have; None for a missing object.
_Bounds = Optional[Tuple[int, Optional[int]]]


def _probe(store: "ObjectStore", name: str, at: int, width: int) -> Tuple[_Bounds, bytes]:
    """What a read of bytes ``[at, at + width)`` of ``name`` tells of its size, and the bytes it read."""
    future = store._kv.read(name, byte_range=slice(at, at + width))
    try:
        res = store._wait(future, f"reading {name}")
    except CheckpointingError:
        error = None if future.cancelled() else future.exception()
        if not ends_before(error):
            raise
        total = _TOTAL.search(str(error))
        if total is not None:  # the object ends inside the window
            return (int(total.group(1)), int(total.group(1))), b""
        return (0, at), b""  # it ends at or before ``at`` (the server answered 416)
    if res.state != "value":
        return None, b""
    return (at + len(res.value), None), bytes(res.value)


def _size(store: "ObjectStore", name: str, limit: int) -> Tuple[Optional[int], bytes]:
    """:func:`object_size`, and the object's first bytes when the first probe read them whole."""
    if limit + 1 > WINDOW and store._larger_than(name, limit):  # one byte: the cheap refusal
        return limit + 1, b""
    low, high = 0, limit + 1  # low <= size <= high
    at, width, head = 0, min(WINDOW, limit + 1), b""
    while True:
        bounds, got = _probe(store, name, at, width)
        if bounds is None:
            return None, b""
        head = got if at == 0 else head
        low, high = max(low, bounds[0]), high if bounds[1] is None else min(high, bounds[1])
        if low > high:  # each probe saw another object
            raise CheckpointingError(f"checkpoint {store.url}: {name} changed while its size was read (replaced "
                                     f"by another object meanwhile); read it again")
        if low == high or low > limit:
            return min(low, limit + 1), head
        if high - low < _STEP:  # the window [low, high] holds its end: exact
            at, width = low, high - low + 1
        else:  # growing by 4x while no end was seen, then halving
            at, width = min(max(4 * low, WINDOW), low + (high - low) // 2), _STEP


def object_size(store: "ObjectStore", name: str, limit: int) -> Optional[int]:
    """The size of the object ``name``, None when it is missing; ``limit + 1`` when it holds more than
    ``limit`` bytes (not searched further). Ranged reads: one of at most :data:`WINDOW` bytes, which
    finds an object smaller than that, then about twice log2(size / WINDOW) of at most 256 KiB."""
    return _size(store, name, limit)[0]


def read_bounded(store: "ObjectStore", name: str, limit: int) -> Tuple[Optional[bytes], int]:
    """``(bytes, size)`` of the object ``name``: ``(None, 0)`` when missing, ``(None, size)`` when its
    size is past ``limit`` (nothing more of it read); else at most ``size`` bytes read, in the byte
    range ``[0, size)`` (not the whole object: it may have been replaced by a larger one since)."""
    size, head = _size(store, name, limit)
    if size is None or size > limit:
        return None, size or 0
    if len(head) >= size:
        return head[:size], size
    rest = size - len(head)  # the first window's bytes are not read twice
    res = store._wait(store._kv.read(name, byte_range=slice(len(head), size)), f"reading {name}", rest <= WINDOW)
    if res.state != "value":
        return None, 0
    return head + bytes(res.value), size


def first_larger(store: "ObjectStore", limits: Dict[str, int]) -> Optional[str]:
    """The first of the objects ``name -> limit`` (sorted) that holds more than its limit, None when
    none does (a missing one included): the byte past each limit read, all requests issued at once."""
    pending = [(name, read_past(store._kv, store._key(name), limit)) for name, limit in sorted(limits.items())]
    found = None
    for name, future in pending:
        try:
            res = store._wait(future, f"reading {name}")
        except CheckpointingError:
            if future.cancelled() or not ends_before(future.exception()):
                raise
            continue
        if found is None and holds_byte(res):
            found = name
    return found


# The most checkpoints a "no commit marker" error names, and the longest its look around may take: it only
# helps the error say more, so a large bucket's listing is given up on rather than waited for.
_NAMED, _LOOK_S = 5, 10.0


def what_is_there(store: "ObjectStore") -> str:
    """What a location without a commit marker holds, for the error saying so, in words: an object of the URL's
    own name (a file, not a checkpoint), the checkpoints below it (a ``ModelCheckpoint`` directory given for
    one of its checkpoints), other objects, or nothing (a typo in the prefix). A look that fails or takes
    longer than :data:`_LOOK_S` says only that it is no checkpoint."""
    plain = "not a checkpoint, or its first save never committed"
    try:
        loc = parse_s3_url(store.url)
        if loc.prefix and type(store)(store.url.rpartition("/")[0], store.options).size(
                loc.prefix.rpartition("/")[2], 0) is not None:
            return (f"{store.url} is an object (a file), not a checkpoint, which is a prefix holding COMMITTED and "
                    f"v-<version>/: give the location the checkpoint was saved to")
        future = store._kv.list()
        try:
            keys = sorted(k.decode() for k in future.result(timeout=min(answer_timeout(), _LOOK_S)))
        except TimeoutError:
            future.cancel()
            return plain
    except Exception:  # a look for the message's sake: the error it adds to stands without it
        return plain
    below = [k[:-len("/COMMITTED")] for k in keys if k.endswith("/COMMITTED")]
    if below:
        named = ", ".join(f"{store.url}/{k}" for k in below[:_NAMED]) + (", ..." if len(below) > _NAMED else "")
        return f"it holds {len(below)} checkpoint(s) below it, give one of them: {named}"
    if not keys:
        return "nothing is stored under it: check the bucket and the prefix for a typo"
    return f"{plain} (it holds {len(keys)} object(s), none of them a checkpoint's commit marker)"
