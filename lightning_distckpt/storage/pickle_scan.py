"""A pickle's opcodes read, before it is loaded, for what loading it would hash without bound.

Loading a pickle hashes what it builds: a dict's keys, a set's items, a constructor's arguments
(``set``, ``dict``, ``OrderedDict``, and frozen dataclasses such as DCP's ``MetadataIndex`` hash
theirs). Python hashes a tuple by recursing into it in C, past the interpreter's recursion limit and
once per path: a dict key of 1-tuples nested 200,000 deep (a 200 KB ``common.pt``) crashed the
loading process (SIGSEGV), and one of shared tuples ``x = (x, x)`` 40 deep (1 KB) hashes 2**40 items
(hours). No later check (``core/tree_walk.py`` walks what was loaded) comes first.

For torch's unpickler (``common.pt``, ShardedObjects, torch files), which we cannot hook,
:func:`check_pickle_bytes` (a ``data.pkl`` in memory) and :func:`check_pickle` (the pre-1.6 stream)
follow the opcodes with a record per object (how deep it nests, how many places it reaches counted at
every path: what hashing it visits), build nothing, and refuse, with a FormatError naming the file, a
tuple, frozenset or constructed object nested deeper than :data:`MAX_HASHED_DEPTH` or reaching more
than max(:data:`MIN_PLACES`, :data:`PLACES_PER_OPCODE` x its opcodes) places, a constructor's argument
or dict key or set item as deep, and an object filled in (``BUILD``) after a tuple took it. A pickle
that is no pickle (truncated, an unknown opcode, a length past its end) is a FormatError too: the reads
are bounded by the bytes present. Our own unpickler (DCP's ``.metadata``) calls :func:`check_hashed`
on the objects themselves before each hash.
"""

from __future__ import annotations

import contextlib
import io
import pickletools
from typing import Any, BinaryIO, Dict, List, Optional

from ..core.errors import FormatError

MAX_HASHED_DEPTH = 1000  # hashing recurses in C (about 100,000 levels crash); real keys nest a few levels
MIN_PLACES, PLACES_PER_OPCODE = 1 << 20, 16  # a tree without sharing has a place per opcode at most

_LEAF_OPS = frozenset((
    "INT", "BININT", "BININT1", "BININT2", "LONG", "LONG1", "LONG4", "STRING", "BINSTRING", "SHORT_BINSTRING",
    "BINBYTES", "SHORT_BINBYTES", "BINBYTES8", "BYTEARRAY8", "NONE", "NEWTRUE", "NEWFALSE", "UNICODE",
    "SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "FLOAT", "BINFLOAT", "GLOBAL", "PERSID", "EXT1", "EXT2",
    "EXT4", "NEXT_BUFFER", "EMPTY_TUPLE"))
_EMPTY_OPS = frozenset(("EMPTY_LIST", "EMPTY_DICT", "EMPTY_SET"))
_IGNORED_OPS = frozenset(("PROTO", "FRAME", "STOP"))


class _Record:
    """What the scan knows of one object: its nesting and places (counted at every path) as far as it is
    filled in now, the records it holds where it is a tuple (fixed once made: a list in it may be filled
    in later, which :meth:`_Scan.made` reads again), whether a tuple or a constructor took it."""

    __slots__ = ("depth", "places", "kids", "captured")

    def __init__(self, kids: Optional[List["_Record"]] = None, tuple_: bool = False) -> None:
        self.kids = kids if tuple_ else None
        self.captured = False
        self.depth, self.places = 1, 1
        self.add(kids or [])

    def add(self, kids: List["_Record"]) -> None:
        for kid in kids:
            self.depth, self.places = max(self.depth, kid.depth + 1), self.places + kid.places


class _Scan:
    def __init__(self, where: str, limit: int) -> None:
        self.where, self.limit = where, limit
        self.stack: List[Any] = []  # records, and _MARK
        self.marks: List[int] = []
        self.memo: Dict[Any, _Record] = {}

    def refuse(self, what: str, record: _Record) -> FormatError:
        return FormatError(f"{self.where}: {what} nested {record.depth} deep and reaching {record.places} places (at "
                           f"most {MAX_HASHED_DEPTH} and {self.limit}): loading would hash it that far (Python "
                           f"hashes in C, without a recursion limit); refused before unpickling (damaged or hostile)")

    def hashed(self, records: List[_Record], what: str) -> None:
        for r in records:
            if r.depth > MAX_HASHED_DEPTH or r.places > self.limit:
                raise self.refuse(what, r)

    def made(self, kids: List[_Record], what: str) -> _Record:
        """A new tuple, frozenset or object of ``kids`` (a constructor's arguments are as they are now)."""
        fresh = [_Record(k.kids, True) if k.kids is not None else k for k in kids]  # its lists as filled now
        record = _Record(fresh, tuple_=what == "a tuple")
        self.hashed([record], what)
        for kid in kids:
            kid.captured = True
        return record

    def pop_mark(self) -> List[_Record]:
        at = self.marks.pop()
        items = self.stack[at:]
        del self.stack[at:]
        return items

    def step(self, name: str, arg: Any) -> None:  # noqa: C901 - one branch per kind of opcode
        stack = self.stack
        if name in ("BINGET", "LONG_BINGET", "GET"):  # the commonest first
            if arg not in self.memo:
                raise FormatError(f"{self.where}: the pickle refers to memo entry {arg}, which it never stored "
                                  "(damaged)")
            stack.append(self.memo[arg])
        elif name in ("BINPUT", "LONG_BINPUT", "PUT"):
            self.memo[arg] = stack[-1]
        elif name in _LEAF_OPS:
            stack.append(_Record([], tuple_=name == "EMPTY_TUPLE"))
        elif name in _EMPTY_OPS:
            stack.append(_Record())
        elif name in ("BINPERSID", "READONLY_BUFFER"):
            stack[-1] = _Record()
        elif name == "STACK_GLOBAL":
            del stack[-2:]
            stack.append(_Record())
        elif name in ("TUPLE1", "TUPLE2", "TUPLE3"):
            n = int(name[-1])
            kids = stack[-n:]
            del stack[-n:]
            stack.append(self.made(kids, "a tuple"))
        elif name in ("TUPLE", "FROZENSET", "INST", "OBJ"):
            kids = self.pop_mark()
            if name == "FROZENSET":
                self.hashed(kids, "a set's item")
            stack.append(self.made(kids, "a tuple" if name == "TUPLE" else "a set" if name == "FROZENSET" else
                                   "a constructed object"))
        elif name in ("LIST", "DICT"):
            items = self.pop_mark()
            if name == "DICT":
                self.hashed(items[::2], "a dict key")
            stack.append(_Record(items))
        elif name in ("APPEND", "SETITEM"):
            n = 1 if name == "APPEND" else 2
            items = stack[-n:]
            del stack[-n:]
            if name == "SETITEM":
                self.hashed(items[:1], "a dict key")
            stack[-1].add(items)
        elif name in ("APPENDS", "SETITEMS", "ADDITEMS"):
            items = self.pop_mark()
            if name != "APPENDS":
                self.hashed(items[::2] if name == "SETITEMS" else items, "a dict key" if name == "SETITEMS"
                            else "a set's item")
            stack[-1].add(items)
        elif name in ("REDUCE", "NEWOBJ", "NEWOBJ_EX"):
            n = 3 if name == "NEWOBJ_EX" else 2
            kids = stack[-n:]
            del stack[-n:]
            stack.append(self.made(kids, "a constructor's arguments"))
        elif name == "BUILD":
            state = stack.pop()
            target = stack[-1]
            before = target.depth
            target.add([state])
            if target.captured and target.depth > before:
                raise FormatError(f"{self.where}: an object filled in (BUILD) after a tuple took it: its nesting "
                                  "is not what the tuple holds; refused before unpickling (damaged or hostile)")
            self.hashed([target], "a constructed object")
        elif name == "MEMOIZE":
            self.memo[len(self.memo)] = stack[-1]
        elif name == "MARK":
            self.marks.append(len(stack))
        elif name == "POP":
            stack.pop()
        elif name == "POP_MARK":
            self.pop_mark()
        elif name == "DUP":
            stack.append(stack[-1])
        elif name not in _IGNORED_OPS:
            raise FormatError(f"{self.where}: the pickle holds opcode {name}, which this check does not know")


class _Bounded(io.RawIOBase):
    """``f`` from its position to ``end``: a read asks for at most what is left (a length field claiming
    4 GB in a short file reads what is there, allocating no more)."""

    def __init__(self, f: BinaryIO, end: int) -> None:
        super().__init__()
        self._f, self._end = f, end

    def read(self, n: int = -1) -> bytes:
        left = max(0, self._end - self._f.tell())
        return self._f.read(left if n is None or n < 0 else min(n, left))

    def readline(self, size: Optional[int] = -1) -> bytes:
        left = max(0, self._end - self._f.tell())
        return self._f.readline(left if size is None or size < 0 else min(size, left))

    def tell(self) -> int:
        return self._f.tell()


# opcode byte -> (name, how its argument is spelled: bytes of a fixed size, or pickletools' codes for a
# line (-1, GLOBAL and INST: two) and for a length of 1, 4 (signed), 4 or 8 bytes before the bytes (-2..-5))
_TABLE = {op.code.encode("latin-1")[0]: (op.name, op.arg.n if op.arg is not None else 0)
          for op in pickletools.opcodes}
_LENGTH = {-2: (1, False), -3: (4, True), -4: (4, False), -5: (8, False)}
_NUMBERED = frozenset(("BINGET", "LONG_BINGET", "BINPUT", "LONG_BINPUT", "GET", "PUT"))


def check_pickle_bytes(data: bytes, where: str) -> None:
    """:func:`check_pickle` of the one pickle at the start of ``data`` (in memory: read here opcode by
    opcode, several times faster than ``pickletools.genops``)."""
    scan, pos, end = _Scan(where, max(MIN_PLACES, PLACES_PER_OPCODE * len(data))), 0, len(data)
    while True:
        if pos >= end:
            raise FormatError(f"{where}: not a readable pickle (it ends before its STOP opcode)")
        code = data[pos]
        pos += 1
        if code not in _TABLE:
            raise FormatError(f"{where}: not a readable pickle (opcode {code:#04x} at byte {pos - 1})")
        name, n = _TABLE[code]
        arg: Any = None
        if n > 0:
            if name in _NUMBERED:
                arg = int.from_bytes(data[pos:pos + n], "little")
            pos += n
        elif n == -1:
            for _ in range(2 if name in ("GLOBAL", "INST") else 1):
                nl = data.find(b"\n", pos)
                if nl < 0:
                    raise FormatError(f"{where}: not a readable pickle ({name} at byte {pos - 1} has no line end)")
                if name in _NUMBERED:
                    arg = int(data[pos:nl]) if data[pos:nl].strip().isdigit() else None
                pos = nl + 1
        elif n < 0:
            width, signed = _LENGTH[n]
            length = int.from_bytes(data[pos:pos + width], "little", signed=signed)
            pos += width + length
            if length < 0 or pos > end:
                raise FormatError(f"{where}: not a readable pickle ({name} claims {length} bytes, past its end)")
        if pos > end:
            raise FormatError(f"{where}: not a readable pickle (cut short inside {name})")
        if name == "STOP":
            return
        try:
            scan.step(name, arg)
        except (IndexError, KeyError) as e:  # an opcode on a stack too short for it, a MARK missing: damaged
            raise FormatError(f"{where}: not a readable pickle ({name} at byte {pos}: {type(e).__name__})") from None


def check_pickle(f: BinaryIO, where: str, size: int) -> None:
    """Scan the one pickle at ``f``'s position (``size`` bytes of it at most, read up to its STOP), as the
    module says; ``f`` is left after it. FormatError naming ``where`` when it is refused or no pickle."""
    limit = max(MIN_PLACES, PLACES_PER_OPCODE * size)
    scan = _Scan(where, limit)
    try:
        for op, arg, _ in pickletools.genops(_Bounded(f, f.tell() + size)):
            scan.step(op.name, arg)
    except FormatError:
        raise
    except (ValueError, IndexError, KeyError, EOFError) as e:  # truncated, a short stack, an unknown opcode
        raise FormatError(f"{where}: not a readable pickle ({type(e).__name__}: {str(e)[:200]})") from None


def check_archive_pickle(source: Any, where: str) -> None:
    """:func:`check_pickle_bytes` of the ``data.pkl`` of the ``torch.save`` zip archive ``source`` (a path or
    a seekable file, left where it was)."""
    import zipfile

    from .zip_records import _record_bytes

    position = None if isinstance(source, (str, bytes)) or hasattr(source, "__fspath__") else source.tell()
    try:
        with contextlib.ExitStack() as stack:
            f = source if position is not None else stack.enter_context(open(source, "rb"))
            archive = stack.enter_context(zipfile.ZipFile(f))
            pickles = [i for i in archive.infolist() if i.filename.endswith("/data.pkl") and i.filename.count("/") == 1]
            for info in pickles[:1]:
                what = f"{where} ({info.filename})"
                if info.compress_type == zipfile.ZIP_STORED and not info.CRC:
                    # torch.save without CRC-32s (torch.utils.serialization.config.save.compute_crc32 = False)
                    # records 0, which zipfile's reader takes for a damaged record; torch reads it as stored
                    check_pickle_bytes(_record_bytes(f, archive, info, where), what)
                    continue
                check_pickle_bytes(archive.read(info), what)  # whole, as torch reads it (inflation checked)
    except (zipfile.BadZipFile, OSError, EOFError, RuntimeError) as e:  # check_records said what is wrong first
        raise FormatError(f"{where}: not a readable torch.save archive: {type(e).__name__}: {e}") from None
    finally:
        if position is not None:
            source.seek(position)


def check_stream_pickles(f: BinaryIO, where: str, count: int = 5) -> None:
    """:func:`check_pickle` of the first ``count`` pickles at ``f``'s position, one after another (torch's
    pre-1.6 format: magic number, protocol, system info, the object, its storages' keys), within the bytes
    left; ``f`` is left where it was."""
    position = f.tell()
    end = f.seek(0, io.SEEK_END)
    f.seek(position)
    try:
        for _ in range(count):
            if f.tell() >= end:
                break
            check_pickle(f, where, end - f.tell())
    finally:
        f.seek(position)


def check_hashed(values: Any, where: str, limit: int = MIN_PLACES) -> None:
    """FormatError unless hashing each of ``values`` (objects a pickle built: a dict's keys, a set's items,
    as an unpickler of our own is about to hash them) recurses at most :data:`MAX_HASHED_DEPTH` deep and
    visits at most ``limit`` places: tuples, frozensets and records (their fields) are followed, shared
    ones counted at every path (each walked once), without recursion; one holding itself is refused."""
    extents: Dict[int, Any] = {}  # id -> (depth, places) once walked; _OPEN while it is
    pending: Dict[int, Any] = {}  # id -> (what hashing it follows, how many leaves it holds) while it is walked
    for value in values:
        stack = [(value, 1)] if _hash_kids(value) is not None else []
        while stack:
            node, level = stack[-1]
            state = extents.get(id(node))
            if state is None:  # first reached: its kids next
                if level > MAX_HASHED_DEPTH:
                    raise _too_far(where, f"nested more than {MAX_HASHED_DEPTH} deep", limit)
                extents[id(node)] = _OPEN
                kids, leaves = [], 0
                for kid in _hash_kids(node) or ():
                    if _hash_kids(kid) is None:
                        leaves += 1
                    elif extents.get(id(kid)) is _OPEN:
                        raise FormatError(f"{where}: a dict key or set item contains itself; refused (damaged or "
                                          "hostile)")
                    else:
                        kids.append(kid)
                        if id(kid) not in extents:
                            stack.append((kid, level + 1))
                pending[id(node)] = (kids, leaves)
                continue
            stack.pop()
            if state is _OPEN:  # its kids are walked: its own extent
                kids, leaves = pending.pop(id(node))
                depth = 1 + max((extents[id(k)][0] for k in kids), default=0)
                places = 1 + leaves + sum(extents[id(k)][1] for k in kids)
                if depth > MAX_HASHED_DEPTH or places > limit:
                    raise _too_far(where, f"nested {depth} deep, reaching {places} places", limit)
                extents[id(node)] = (depth, places)


def _too_far(where: str, what: str, limit: int) -> FormatError:
    return FormatError(f"{where}: a dict key or set item {what} (at most {MAX_HASHED_DEPTH} deep and {limit} "
                       "places): loading would hash it that far (Python hashes in C, without a recursion limit); "
                       "refused (damaged or hostile)")


_OPEN = object()


def _hash_kids(node: Any) -> Optional[List[Any]]:
    """What hashing ``node`` hashes in turn: a tuple's or frozenset's items, a record's fields; None for
    anything hashed without looking inside (str, int, a class) or that cannot be hashed (a list)."""
    if isinstance(node, (tuple, frozenset)):
        return list(node)
    fields = getattr(node, "__dict__", None)
    if isinstance(fields, dict) and not isinstance(node, type):
        return list(fields.values())
    return None
