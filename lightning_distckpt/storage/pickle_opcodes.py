"""The opcode-by-opcode scan behind :mod:`.pickle_scan`: the unpickler's stack, marks and memo followed with
a record per object (how deep it nests, how many places it reaches), nothing built. It runs before every
load of a ``common.pt``, a ShardedObject and a torch file, so it is written for speed: one loop dispatching
on the opcode's byte, the commonest opcodes first; one shared record for every leaf until something can
reach it again or change it; a container's items counted in C where there are many. Its verdicts are the
genops-based scan's before it (tests/unit/test_pickle_scan_equivalence.py).
"""

from __future__ import annotations

import operator
import pickletools
import struct
from typing import Any, Dict, List, Optional, Tuple

from ..core.errors import FormatError, UnsafeContentError, allow_type_advice

MAX_HASHED_DEPTH = 1000  # hashing recurses in C (about 100,000 levels crash); real keys nest a few levels
MIN_PLACES, PLACES_PER_OPCODE = 1 << 20, 16  # a tree without sharing has a place per opcode at most

# A record is what the scan knows of one object, a list (the cheapest thing to make, one per container):
# [how deep it nests, how many places it reaches (counted at every path) as far as it is filled in now, the
# records it holds where it is a tuple (fixed once made: a list in it may be filled in later, which
# Scan.made reads again) else None, whether a tuple or a constructor took it].
_DEPTH, _PLACES = operator.itemgetter(0), operator.itemgetter(1)
# What a leaf (a number, a string, a class, an empty tuple) pushes while only one place on the stack holds
# it: one shared record, never changed; _own gives it a record of its own before a memo entry or DUP can
# reach it again or a BUILD or fill-in changes it (the verdict is as if each leaf had its own from the start).
_LEAF: List[Any] = [1, 1, None, False]
_EMPTY_TUPLE: List[Any] = [1, 1, [], False]


def _own(stack: List[Any]) -> List[Any]:
    top = stack[-1]
    if top is _LEAF or top is _EMPTY_TUPLE:
        top = stack[-1] = [1, 1, top[2], False]
    return top


class Scan:
    """The unpickler's stack, marks and memo, as records; what is refused, and where."""

    __slots__ = ("where", "limit", "stack", "marks", "memo", "offset", "bytes_call_only")

    def __init__(self, where: str, limit: int, bytes_call_only: bool = True) -> None:
        self.where, self.limit, self.offset = where, limit, 0  # offset: where the bytes scanned now start
        self.bytes_call_only = bytes_call_only  # builtins.bytes only as bytes() (_bytes_call); False: the
        # user allowed the type, which then loads as torch's unpickler has it
        self.stack: List[Any] = []
        self.marks: List[int] = []
        self.memo: Dict[Any, List[Any]] = {}

    def refuse(self, what: str, record: List[Any]) -> FormatError:
        return FormatError(f"{self.where}: {what} nested {record[0]} deep and reaching {record[1]} places (at most "
                           f"{MAX_HASHED_DEPTH} and {self.limit}): loading would hash it that far (Python "
                           f"hashes in C, without a recursion limit); refused before unpickling (damaged or hostile)")

    def hashed(self, records: List[Any], what: str) -> None:
        if records and (max(map(_DEPTH, records)) > MAX_HASHED_DEPTH or max(map(_PLACES, records)) > self.limit):
            raise self.refuse(what, next(r for r in records if r[0] > MAX_HASHED_DEPTH or r[1] > self.limit))

    def made(self, kids: List[Any], what: str) -> List[Any]:
        """A new tuple, frozenset or object of ``kids`` (a constructor's arguments are as they are now)."""
        depth, places, fresh = 0, 1, [] if what == "a tuple" else None  # a tuple's kids kept as they are now
        for kid in kids:
            if kid[2] is not None:  # a tuple: as the lists in it are filled in now
                kid = _tuple(kid[2])
            if fresh is not None:
                fresh.append(kid)
            depth = kid[0] if kid[0] > depth else depth
            places += kid[1]
        record = [depth + 1, places, fresh, False]
        if depth >= MAX_HASHED_DEPTH or places > self.limit:
            raise self.refuse(what, record)
        for kid in kids:  # a shared leaf's flag too: no one reads it (_own gives a new one)
            kid[3] = True
        return record

    def pop_mark(self) -> List[Any]:
        at = self.marks.pop()
        items = self.stack[at:]
        del self.stack[at:]
        return items

    def fill(self, items: List[Any], what: Optional[str]) -> None:
        """The container on the stack filled in with ``items`` (its keys or set items hashed: ``what``)."""
        hashed = () if what is None else items[::2] if what == "a dict key" else items
        if len(items) < 8:  # a few: each in turn (exact where it holds itself)
            for key in hashed:
                if key[0] > MAX_HASHED_DEPTH or key[1] > self.limit:
                    raise self.refuse(what, key)  # type: ignore[arg-type]
        elif hashed and (max(map(_DEPTH, hashed)) > MAX_HASHED_DEPTH or max(map(_PLACES, hashed)) > self.limit):
            self.hashed(hashed, what)  # type: ignore[arg-type]
        target = self.stack[-1]
        if target is _LEAF or target is _EMPTY_TUPLE:
            target = self.stack[-1] = [1, 1, target[2], False]
        if len(items) < 8 or id(target) in map(id, items):  # it may hold itself: each item adds to it in turn
            for kid in items:
                depth = kid[0] + 1
                target[0] = depth if depth > target[0] else target[0]
                target[1] += kid[1]
        else:
            depth = max(map(_DEPTH, items)) + 1
            target[0] = depth if depth > target[0] else target[0]
            target[1] += sum(map(_PLACES, items))

    def build(self) -> None:
        """BUILD: the object under the top filled in with the top (its state)."""
        stack = self.stack
        state = stack.pop()
        target = stack[-1]
        if target is _LEAF or target is _EMPTY_TUPLE:
            target = stack[-1] = [1, 1, target[2], False]
        before = target[0]
        target[0], target[1] = max(before, state[0] + 1), target[1] + state[1]
        if target[3] and target[0] > before:
            raise FormatError(f"{self.where}: an object filled in (BUILD) after a tuple took it: its nesting "
                              "is not what the tuple holds; refused before unpickling (damaged or hostile)")
        if target[0] > MAX_HASHED_DEPTH or target[1] > self.limit:
            raise self.refuse("a constructed object", target)


def _tuple(kids: List[Any]) -> List[Any]:
    """A tuple's record as the lists it holds are filled in now."""
    if not kids:
        return _EMPTY_TUPLE
    return [1 + max(map(_DEPTH, kids)), 1 + sum(map(_PLACES, kids)), kids, False]


_OPS = {op.code.encode("latin-1")[0]: op for op in pickletools.opcodes}
_NAMES = [_OPS[c].name if c in _OPS else f"{c:#04x}" for c in range(256)]
# opcode byte -> what the scan does with it, in scan_opcodes's order (the commonest first; the rest in _rare)
_PUSH_K, _GET_K, _PUT_K, _SIZED_K, _MARK_K, _FILL_K, _MADE_K, _BUILD_K, _SHORT_K, _MEMOIZE_K, _MARK_MADE_K, \
    _SKIP_K, _STOP_K, _RARE_K, _UNKNOWN_K = range(15)
_GROUPS = {
    _PUSH_K: "BININT BININT1 BININT2 BINFLOAT NONE NEWTRUE NEWFALSE EXT1 EXT2 EXT4 NEXT_BUFFER EMPTY_TUPLE "
             "EMPTY_DICT EMPTY_LIST EMPTY_SET",  # an empty container's record is a leaf's until _own
    _GET_K: "BINGET LONG_BINGET", _PUT_K: "BINPUT LONG_BINPUT", _SIZED_K: "BINUNICODE BINBYTES", _MARK_K: "MARK",
    _FILL_K: "SETITEMS APPENDS ADDITEMS SETITEM APPEND", _MADE_K: "TUPLE1 TUPLE2 TUPLE3 REDUCE NEWOBJ NEWOBJ_EX",
    _BUILD_K: "BUILD", _SHORT_K: "SHORT_BINUNICODE SHORT_BINBYTES SHORT_BINSTRING LONG1", _MEMOIZE_K: "MEMOIZE",
    _MARK_MADE_K: "TUPLE FROZENSET OBJ", _SKIP_K: "PROTO FRAME", _STOP_K: "STOP"}
_BY_NAME = {op.name: code for code, op in _OPS.items()}
_KIND = [_UNKNOWN_K if c not in _OPS else _RARE_K for c in range(256)]
for _kind, _names in _GROUPS.items():
    for _name in _names.split():
        _KIND[_BY_NAME[_name]] = _kind
_PUSHED = [_EMPTY_TUPLE if c == _BY_NAME["EMPTY_TUPLE"] else _LEAF for c in range(256)]
# bytes an opcode takes before what a length counts: itself and its fixed-size argument, or its length field
_ARG_BYTES = {-1: 0, -2: 1, -3: 4, -4: 4, -5: 8}  # pickletools' codes: a line, lengths of 1, 4 (signed), 4, 8
_WIDTH = [1 + (0 if op is None or op.arg is None else _ARG_BYTES.get(op.arg.n, op.arg.n))
          for op in map(_OPS.get, range(256))]
HEADER_BYTES = max(_WIDTH)  # what a window of a stream must hold past an opcode's start (check_pickle)
_WHAT = {"TUPLE": "a tuple", "TUPLE1": "a tuple", "TUPLE2": "a tuple", "TUPLE3": "a tuple", "FROZENSET": "a set",
         "OBJ": "a constructed object", "REDUCE": "a constructor's arguments", "NEWOBJ": "a constructor's arguments",
         "NEWOBJ_EX": "a constructor's arguments", "SETITEMS": "a dict key", "SETITEM": "a dict key",
         "ADDITEMS": "a set's item"}
_WHAT_BY_CODE = [_WHAT.get(name) for name in _NAMES]
# how many items on the stack an opcode takes (0: those above the last MARK)
_TAKES = {"TUPLE1": 1, "TUPLE2": 2, "TUPLE3": 3, "REDUCE": 2, "NEWOBJ": 2, "NEWOBJ_EX": 3, "APPEND": 1, "SETITEM": 2}
_TAKES_BY_CODE = [_TAKES.get(name, 0) for name in _NAMES]
_U4 = struct.Struct("<I").unpack_from


def scan_opcodes(scan: Scan, data: bytes, pos: int, end: int) -> Tuple[int, bool]:  # noqa: C901 - a branch per kind
    """Follow the opcodes of ``data`` from ``pos`` while one starts before ``end`` (the bytes a header takes
    past it are there, or ``data`` ends); the position after STOP and True, or where it stopped and False
    (a line op whose end is not in ``data`` yet stops at its start). The commonest opcodes first (module doc)."""
    stack, marks, memo, kinds, widths, pushed = scan.stack, scan.marks, scan.memo, _KIND, _WIDTH, _PUSHED
    push, code, leaf, whats, takes = stack.append, 0, _LEAF, _WHAT_BY_CODE, _TAKES_BY_CODE
    push_k, get_k, put_k, sized_k, mark_k, fill_k, made_k, build_k, short_k, memoize_k, mark_made_k, skip_k, \
        stop_k, rare_k = range(14)  # _KIND's, as locals: read the fastest
    try:
        while pos < end:
            code = data[pos]
            kind = kinds[code]
            if kind == push_k:
                push(pushed[code])
                pos += widths[code]
            elif kind == get_k:
                top, after = memo[data[pos + 1] if code == 104 else _U4(data, pos + 1)[0]], pos + widths[code]
                if top is _BYTES:  # (104: BINGET) builtins.bytes again: called as bytes() right here, or refused
                    after = _bytes_call(scan, data, pos, after)
                    if after < 0:
                        return pos, False
                else:
                    push(top)
                pos = after
            elif kind == put_k:
                top = stack[-1]
                if top is leaf or top is _EMPTY_TUPLE:  # a memo entry reaches it again: a record of its own
                    top = stack[-1] = [1, 1, top[2], False]
                memo[data[pos + 1] if code == 113 else _U4(data, pos + 1)[0]] = top  # 113: BINPUT
                pos += widths[code]
            elif kind == sized_k:
                push(leaf)
                pos += 5 + _U4(data, pos + 1)[0]
            elif kind == mark_k:
                marks.append(len(stack))
                pos += 1
            elif kind == fill_k or kind == made_k:
                n = takes[code]
                at = -n if n else marks.pop()
                items = stack[at:]
                del stack[at:]
                if kind == fill_k:
                    scan.fill(items, whats[code])
                else:
                    push(scan.made(items, whats[code]))
                pos += 1
            elif kind == build_k:
                scan.build()
                pos += 1
            elif kind == short_k:
                push(leaf)
                pos += 2 + data[pos + 1]
            elif kind == memoize_k:
                memo[len(memo)] = _own(stack)
                pos += 1
            elif kind == mark_made_k:
                kids = scan.pop_mark()
                if code == 0x91:  # FROZENSET
                    scan.hashed(kids, "a set's item")
                push(scan.made(kids, whats[code]))
                pos += 1
            elif kind == skip_k:
                pos += widths[code]
            elif kind == stop_k:
                return pos + 1, True
            elif kind == rare_k:
                after = _rare(scan, data, pos, code)
                if after < 0:
                    return pos, False
                pos = after
            else:
                raise FormatError(f"{scan.where}: not a readable pickle (opcode {code:#04x} at byte "
                                  f"{scan.offset + pos})")
    except KeyError as e:  # the only dict read is the memo's
        raise FormatError(f"{scan.where}: the pickle refers to memo entry {e.args[0]}, which it never stored "
                          "(damaged)") from None
    except (IndexError, struct.error):  # a stack too short, a MARK missing, a number cut short: damaged
        raise FormatError(f"{scan.where}: not a readable pickle ({_NAMES[code]} at byte {scan.offset + pos}: "
                          "its stack, marks or bytes end first)") from None
    return pos, False


def _rare(scan: Scan, data: bytes, pos: int, code: int) -> int:
    """An opcode real pickles rarely hold (protocol 0's lines, a signed length, ...): the position after it,
    or -1 where its line does not end in ``data``."""
    stack, name = scan.stack, _NAMES[code]
    if name in ("BINSTRING", "LONG4", "BINUNICODE8", "BINBYTES8", "BYTEARRAY8"):  # a signed 4 or an 8-byte length
        width = _WIDTH[code]
        length = int.from_bytes(data[pos + 1:pos + width], "little", signed=width == 5)
        if length < 0:
            raise FormatError(f"{scan.where}: not a readable pickle ({name} at byte {scan.offset + pos} claims "
                              f"{length} bytes)")
        stack.append(_LEAF)
        return pos + width + length
    if _OPS[code].arg is not None and _OPS[code].arg.n == -1:  # a line (GLOBAL and INST: two)
        after, lines = pos + 1, []
        for _ in range(2 if name in ("GLOBAL", "INST") else 1):
            nl = data.find(b"\n", after)
            if nl < 0:
                return -1
            line, after = data[after:nl], nl + 1
            lines.append(line)
        key = int(line) if line.strip().isdigit() else None
        if (name == "GET" and scan.memo.get(key) is _BYTES) or (name == "GLOBAL" and scan.bytes_call_only
                                                                 and tuple(lines) in _BYTES_NAMES):
            return _bytes_call(scan, data, pos, after)
        if name == "GET":
            stack.append(scan.memo[key])
        elif name == "PUT":
            scan.memo[key] = _own(stack)
        elif name == "INST":
            stack.append(scan.made(scan.pop_mark(), "a constructed object"))
        else:  # INT, LONG, FLOAT, STRING, UNICODE, PERSID, GLOBAL
            stack.append(_LEAF)
        return after
    if name in ("BINPERSID", "READONLY_BUFFER"):
        stack[-1] = _LEAF
    elif name == "STACK_GLOBAL":
        del stack[-2:]
        stack.append(_LEAF)
    elif name in ("LIST", "DICT"):
        items = scan.pop_mark()
        if name == "DICT":
            scan.hashed(items[::2], "a dict key")
        stack.append([1 + max(map(_DEPTH, items), default=0), 1 + sum(map(_PLACES, items)), None, False])
    elif name == "POP":
        stack.pop()
    elif name == "POP_MARK":
        scan.pop_mark()
    elif name == "DUP":
        stack.append(_own(stack))
    return pos + 1


# builtins.bytes as a GLOBAL spells it (protocol 2 writes Python 2's module; torch's unpickler maps it)
_BYTES_NAMES = {(b"builtins", b"bytes"), (b"__builtin__", b"bytes")}
# The memo entry of builtins.bytes (a leaf's record, never on the stack): each GET of it is checked as the GLOBAL
_BYTES: List[Any] = [1, 1, None, False]
_BINPUT, _LONG_BINPUT, _EMPTY_TUPLE_OP, _REDUCE = b"q"[0], b"r"[0], b")"[0], b"R"[0]


def _bytes_call(scan: Scan, data: bytes, start: int, pos: int) -> int:
    """builtins.bytes pushed by the opcode at ``start`` (a GLOBAL or a GET of its memo entry), which ends at
    ``pos``: loaded only as protocol 2 writes ``b""``, a call with no argument (BINPUT or LONG_BINPUT of it,
    then EMPTY_TUPLE, REDUCE). Anything else (arguments: ``bytes(10**12)`` allocates a terabyte, an iterable
    runs through; NEWOBJ, BUILD, the type kept as a value) is an UnsafeContentError. The position after the
    REDUCE, with the call's result pushed, or -1 where ``data`` ends first (nothing changed)."""
    key = None
    if pos < len(data) and data[pos] in (_BINPUT, _LONG_BINPUT):
        width = 2 if data[pos] == _BINPUT else 5
        if pos + width > len(data):
            return -1
        key = data[pos + 1] if width == 2 else _U4(data, pos + 1)[0]
        pos += width
    if pos + 2 > len(data):
        return -1
    if data[pos] != _EMPTY_TUPLE_OP or data[pos + 1] != _REDUCE:
        raise UnsafeContentError(
            f"{scan.where}: refused to deserialize builtins.bytes (at byte {scan.offset + start}): it loads only "
            "called with no argument, as protocol 2 writes b''; a call with arguments (bytes(10**12) allocates a "
            f"terabyte) or any other use of the type is refused before unpickling (loading runs no code). "
            f"{allow_type_advice('bytes')}")
    if key is not None:
        scan.memo[key] = _BYTES
    scan.stack.append(scan.made([_LEAF, _EMPTY_TUPLE], "a constructor's arguments"))  # as its opcodes made it
    return pos + 2
