"""Parsing JSON from disk in bounded memory. Every JSON text a reader parses (``metadata.json``, the
commit marker, each array's ``zarr.json``, a safetensors header and the CRCs in it, a Hugging Face
index, Megatron-Core's ``metadata.json``) goes through :func:`parse_json`, which scans it first.

``json.loads`` builds a Python object per value: about 6x the text's size for an index we write,
but ``[],[],...`` takes 22 bytes a byte, ``[{"k1":0},{"k2":0},...]`` 26 (``json`` keeps every new
key in a table of its own, and a dict per object), and a text whose one string holds one character
outside the Basic Multilingual Plane 8 (the whole text and that string decode at 4 bytes a
character). :func:`json_shape` counts, in memory of at most about three times the text's size, what the parse
builds: arrays, objects, pairs, strings and their bytes, the keys that are new, the width of the
decoded characters, the nesting. :meth:`JsonShape.parse_bytes` is an upper bound of the parse's
peak memory (checked against ``tracemalloc`` on such texts and ours in
``tests/trust/test_trust_resource_bounds_redteam.py``). A text nested deeper than
:data:`MAX_JSON_DEPTH`, estimated past :data:`PARSE_FLOOR` to take more than :data:`PARSE_RATIO` x
its size, or more than this process's share of the memory available, is refused before parsing. A
text of at most 64 KiB (a ``zarr.json``, the commit marker) is parsed first and its nesting checked on
what it built: whatever it holds, it takes a few MB at most, and the scan would cost more than the parse.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any, List, NamedTuple, Optional, Set, Tuple

import numpy as np

from ..core.errors import FormatError
from ..core.gc_pause import gc_paused

MAX_JSON_DEPTH = 32  # metadata.json nests 6 levels
PARSE_RATIO = 32  # the most estimated bytes a byte of JSON may become, past PARSE_FLOOR
PARSE_FLOOR = 64 << 20  # estimates below this are never refused: no file of ours nears the ratio

# Bytes CPython (64-bit, 3.9-3.13) takes at most, beyond the decoded text:
_LIST = 104  # a list (56) and its first items' array (n + n/8 + 6 slots of 8 bytes: 48 past 8 a slot)
_SLOT = 9  # each further item of a list (8 bytes and an eighth of growth)
_DICT, _PAIR = 128, 66  # a dict, and each pair (an entry and an index, 1.5x while the table grows)
_NUMBER = 32  # an int past the cached -5..256 (and half a byte a digit), or a float
_STR = (56, 80)  # a str beyond its characters: all ASCII, or not
_MEMO = 66  # a new key's entry in json's table of the keys it has seen
_HOOK, _HOOK_LIST = 65, 104  # with object_pairs_hook: a pair's tuple and slot; an object's list of pairs
_BASE = 4096  # the parse's own (the decoder, the top value)
_SMALL = 64 << 10  # texts parsed without the scan: at most ~60 bytes a byte, far below PARSE_FLOOR
_WORD = 8  # keys of at most 2 words are told apart exactly; longer ones are each counted as new
_BLOCK = 4 << 20  # marks scanned at once: the arrays take ~10 bytes a mark of a block
_STRING_BLOCK = 1 << 20  # bytes searched for strings at once: the arrays take up to ~40 bytes a byte of a block
_MARKS = b'[]{}",:'
_NOT_MARKS = bytes(range(256)).translate(None, _MARKS)  # every byte but the marks: deleted
_WHITE = np.zeros(256, dtype=bool)
_WHITE[list(b" \t\r\n")] = True
_MASKS = np.array([(1 << (8 * n)) - 1 for n in range(_WORD)] + [(1 << 64) - 1], dtype=np.uint64)
_HIGH_SURROGATE = re.compile(rb"\\u[dD][89abAB]")  # an escape pair decoding to a character past U+FFFF


class JsonShape(NamedTuple):
    """What :func:`json_shape` counts in a JSON text (structure outside its strings)."""

    depth: int  # the deepest nesting of arrays and objects
    lists: int
    dicts: int
    commas: int
    pairs: int
    strings: int
    content: int = 0  # bytes inside strings
    keys: int = 0  # strings a colon (or white space: taken as a key) follows
    new_keys: int = 0  # distinct keys (at most: a key longer than 2 words counts as new)
    size: int = 0
    width: int = 1  # bytes of a decoded character of the text (1, 2, 4)
    string_width: int = 1  # bytes of a character of its strings (escapes included)
    ascii: bool = True

    @property
    def containers(self) -> int:
        return self.lists + self.dicts

    def parse_bytes(self, hook: bool = False) -> int:
        """At most the memory ``json.loads`` takes for such a text (``hook``: with an object_pairs_hook)."""
        head = _STR[0] if self.ascii else _STR[1]
        values = self.commas + self.pairs + 1  # items and pairs: a comma before all but one of each container's
        numbers = max(0, values - self.strings)  # at most: every value that is no string or container
        plain = max(0, self.size - self.content - 2 * self.strings)  # digits, literals, marks, white space
        return (_BASE + self.width * self.size + self.string_width * self.content + head * (self.strings - self.keys)
                + (head + _MEMO) * self.new_keys + _LIST * self.lists + _SLOT * self.commas + _DICT * self.dicts
                + _PAIR * self.pairs + _NUMBER * numbers + plain // 2
                + ((_HOOK * self.pairs + _HOOK_LIST * self.dicts) if hook else 0))


def parse_json(raw: bytes, where: str, unique_keys: bool = False) -> Any:
    """JSON from disk, its nesting and cost checked first: our files nest a few levels, and a hostile one
    must not drive the parser (or later code) into deep recursion or out of memory. ``unique_keys``: an
    object naming a key twice is a FormatError (a format other readers parse too, where one may take the
    first and another the last: a safetensors header)."""
    if len(raw) <= _SMALL:  # at most a few MB parsed, whatever it holds: its nesting checked on what it built
        try:
            value = _loads(raw, where, unique_keys)
        except _TooDeep:
            pass  # the scan says how deep
        else:
            depth = _depth(value)
            if depth > MAX_JSON_DEPTH:
                raise FormatError(f"{where}: nested {depth} levels deep (at most {MAX_JSON_DEPTH}); not written by us")
            return value
    shape = json_shape(raw, exact_keys=False)  # every key taken as new: enough for most texts, ours included
    if shape.depth > MAX_JSON_DEPTH:
        raise FormatError(f"{where}: nested {shape.depth} levels deep (at most {MAX_JSON_DEPTH}); not written by us")
    refused = parse_refusal(shape, where, unique_keys)
    if refused is not None and shape.keys:
        refused = parse_refusal(json_shape(raw), where, unique_keys)  # the keys told apart: a second scan
    if refused is not None:
        raise refused
    try:
        return _loads(raw, where, unique_keys)
    except _TooDeep as e:
        raise FormatError(f"{where}: not valid JSON (RecursionError: {str(e)[:200]})") from None


def _loads(raw: bytes, where: str, unique_keys: bool) -> Any:
    try:
        with gc_paused():  # a large index is millions of small objects; collections during parsing find nothing
            return json.loads(raw, object_pairs_hook=_unique_pairs) if unique_keys else json.loads(raw)
    except _DuplicateKey as e:
        raise FormatError(f"{where}: names {str(e)[:200]} twice in one object (which one is meant?)") from None
    except RecursionError as e:
        raise _TooDeep(str(e)) from None
    except ValueError as e:
        raise FormatError(f"{where}: not valid JSON ({type(e).__name__}: {str(e)[:200]})") from None


def _depth(value: Any) -> int:
    """How deep arrays and objects nest in the parsed ``value`` (walked without recursion)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, level = stack.pop()
        kids = node.values() if isinstance(node, dict) else node if isinstance(node, list) else None
        if kids is not None:
            deepest = max(deepest, level)
            stack.extend((k, level + 1) for k in kids if isinstance(k, (dict, list)))
    return deepest


class _DuplicateKey(Exception):
    pass


class _TooDeep(Exception):
    pass


def _unique_pairs(pairs: List[Tuple[str, Any]]) -> Any:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: Set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _DuplicateKey(repr(key))
            seen.add(key)
    return out


def parse_refusal(shape: JsonShape, where: str, hook: bool = False) -> Optional[FormatError]:
    """The FormatError refusing to parse a text that would take far more memory than its size (a file of
    empty lists is ~22 bytes a byte: 22 GB for one under the 1 GiB cap) or more than this process's
    share of the memory available (every local rank of a load parses the same files at once); else None."""
    need, size = shape.parse_bytes(hook), shape.size
    if need <= PARSE_FLOOR:
        return None
    if need > PARSE_RATIO * size:
        return FormatError(f"{where}: parsing it would take about {need >> 20} MiB of memory, {need // max(size, 1)}x "
                          f"its {size} bytes ({shape.containers} arrays or objects, {shape.new_keys} distinct keys; "
                          f"an index we write takes under {PARSE_RATIO // 2}x); refused before parsing (damaged or "
                          f"hostile)")
    available, sharing = _available_memory(), _local_processes()
    if available is not None and need > available // sharing:
        shared = f" shared by the {sharing} processes of this node (LOCAL_WORLD_SIZE)" if sharing > 1 else ""
        return FormatError(f"{where}: parsing it would take about {need >> 20} MiB of memory ({need // max(size, 1)}x "
                          f"its {size} bytes), more than the {available >> 20} MiB available{shared}; refused before "
                          f"parsing")
    return None


def _local_processes() -> int:
    """How many processes of this node read at once: ``LOCAL_WORLD_SIZE`` (torchrun), else 1."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def _available_memory() -> Optional[int]:
    """``MemAvailable`` of /proc/meminfo in bytes; None where there is none (not Linux)."""
    try:
        with open("/proc/meminfo", "rb") as f:
            for line in f:
                if line.startswith(b"MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def max_depth(raw: bytes) -> int:
    """The deepest nesting of arrays and objects in the JSON text ``raw`` (strings skipped)."""
    return json_shape(raw).depth


def json_shape(raw: bytes, exact_keys: bool = True) -> JsonShape:
    """What parsing the JSON text ``raw`` builds (:class:`JsonShape`), counted in memory of at most about
    three times its size whatever it holds (a regex over its strings, or arrays over the whole text, took
    ~20 bytes a byte: 20 GB for a 1 GiB index). ``exact_keys=False``: every key counted as new (faster)."""
    text = raw
    if b"\\" in raw:  # escapes paired as JSON pairs them, left to right: escaped backslashes, then quotes
        text = raw.replace(b"\\\\", b"\x01\x01").replace(b'\\"', b"\x02\x02")  # no longer quotes; keys stay apart
    depth, lists, dicts, commas, pairs = _structure(text.translate(None, _NOT_MARKS))
    strings, content, keys, new_keys = _strings(text, exact_keys)
    width, string_width, ascii_only = _widths(raw)
    return JsonShape(depth, lists, dicts, commas, pairs, strings, content, keys, new_keys, len(raw), width,
                     string_width, ascii_only)


def _structure(marks: bytes) -> Tuple[int, int, int, int, int]:
    """(depth, arrays, objects, commas, colons) outside strings, from the text's marks alone."""
    deepest = depth = lists = dicts = commas = pairs = 0
    inside = False  # within a string where the block starts
    for at in range(0, len(marks), _BLOCK):
        block = np.frombuffer(marks, dtype=np.uint8, count=min(_BLOCK, len(marks) - at), offset=at)
        is_quote = block == ord('"')
        outside = np.logical_xor.accumulate(is_quote) == inside  # parity of the quotes so far, this one included
        inside ^= bool(np.count_nonzero(is_quote) & 1)
        lists += int(np.count_nonzero((block == ord("[")) & outside))
        dicts += int(np.count_nonzero((block == ord("{")) & outside))
        commas += int(np.count_nonzero((block == ord(",")) & outside))
        pairs += int(np.count_nonzero((block == ord(":")) & outside))
        opens = ((block == ord("[")) | (block == ord("{"))).view(np.int8)
        closes = ((block == ord("]")) | (block == ord("}"))).view(np.int8)
        steps = (opens - closes)[outside]
        if steps.size:
            levels = np.cumsum(steps, dtype=np.int32)
            deepest, depth = max(deepest, depth + int(levels.max())), depth + int(levels[-1])
    return deepest, lists, dicts, commas, pairs


def _strings(text: bytes, exact_keys: bool) -> Tuple[int, int, int, int]:
    """(strings, bytes inside them, keys, distinct keys at most) of ``text``, whose every quote opens or
    closes a string (escaped ones replaced). A key is a string a colon follows (or white space: counted
    as one). Keys of at most 2 words are told apart by their bytes (``exact_keys``); others each count as new."""
    full = np.frombuffer(text, dtype=np.uint8)
    words = np.ndarray((max(0, len(text) - _WORD + 1),), dtype="<u8", buffer=text, strides=(1,))  # 8 bytes at i
    distinct = _Distinct(len(text))
    strings = content = keys = 0
    carried: List[int] = []  # where the string a block ends inside opened
    for at in range(0, len(text), _STRING_BLOCK):
        quotes = np.flatnonzero(full[at:at + _STRING_BLOCK] == ord('"')) + at
        if carried:
            quotes = np.concatenate((np.array(carried, dtype=quotes.dtype), quotes))
        closed = len(quotes) - len(quotes) % 2
        carried = [int(quotes[-1])] if len(quotes) % 2 else []
        opens, closes = quotes[:closed:2], quotes[1:closed:2]
        strings += len(closes)
        content += int((closes - opens - 1).sum())
        after = np.minimum(closes + 1, len(text) - 1)
        is_key = ((full[after] == ord(":")) | _WHITE[full[after]]) & (closes + 1 < len(text))
        starts, lengths = opens[is_key] + 1, (closes - opens - 1)[is_key]
        keys += len(starts)
        short = (lengths <= 2 * _WORD) & (starts + 2 * _WORD <= len(words)) & exact_keys
        distinct.long += int(np.count_nonzero(~short))
        distinct.add(words, starts[short], lengths[short])
    return strings, content, keys, distinct.count()


class _Distinct:
    """Counts distinct short keys exactly (their two words, masked to their lengths: a key holds no NUL
    byte), or more when two of one hash interleave; keeps at most ~``size`` / 4 bytes of them, past
    which every further key counts as new (the estimate only grows)."""

    def __init__(self, size: int) -> None:
        self.parts: List[np.ndarray] = []
        self.held, self.budget, self.long = 0, size // 4, 0

    def add(self, words: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> None:
        if not len(starts):
            return
        if self.held * 16 > self.budget:
            self.long += len(starts)
            return
        rows = np.empty((len(starts), 2), dtype=np.uint64)
        rows[:, 0] = words[starts] & _MASKS[np.minimum(lengths, _WORD)]
        rows[:, 1] = words[starts + _WORD] & _MASKS[np.clip(lengths - _WORD, 0, _WORD)]
        self.parts.append(_distinct_rows(rows))
        self.held += len(self.parts[-1])
        if len(self.parts) > 8:
            self.parts = [_distinct_rows(np.concatenate(self.parts))]
            self.held = len(self.parts[0])

    def count(self) -> int:
        return self.long + (len(_distinct_rows(np.concatenate(self.parts))) if self.parts else 0)


def _distinct_rows(rows: np.ndarray) -> np.ndarray:
    """The rows of ``rows`` (n x 2 words) without repeats, sorted by a hash of both words; rows of one
    hash that interleave may each stay (more rows, never fewer, than are distinct)."""
    mixed = rows[:, 0] * np.uint64(0x9E3779B97F4A7C15) ^ rows[:, 1]
    ordered = rows[np.argsort(mixed, kind="stable")]
    hashes = ordered[:, 0] * np.uint64(0x9E3779B97F4A7C15) ^ ordered[:, 1]
    new = np.ones(len(ordered), dtype=bool)
    new[1:] = (hashes[1:] != hashes[:-1]) | np.any(ordered[1:] != ordered[:-1], axis=1)
    return ordered[new]


def _widths(raw: bytes) -> Tuple[int, int, bool]:
    """(bytes a decoded character of ``raw`` takes, bytes a character of its strings takes, whether its
    strings are all ASCII): json decodes the whole text to one str, whose width its widest character sets."""
    ascii_text = raw.isascii()
    if ascii_text:
        width = 1
    elif json.detect_encoding(raw) != "utf-8":  # UTF-16 / 32 (or a BOM): not ours, taken at its widest
        width = 4
    else:
        top = int(np.frombuffer(raw, dtype=np.uint8).max())
        width = 4 if top >= 0xF0 else 2 if top >= 0xC4 else 1  # lead bytes of U+10000.. and U+0100..
    strings = width
    # a one-byte search runs ~80x faster than a two-byte one (1 ms for a 1.3 MB index): \u only where \ is
    escapes = b"\\" in raw and b"\\u" in raw
    if escapes:
        strings = 4 if _HIGH_SURROGATE.search(raw) else max(strings, 2)
    return width, strings, ascii_text and not escapes
