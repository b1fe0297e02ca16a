"""The pickle pre-scan (storage/pickle_scan.py: what loading a pickle would hash without bound) was made
several times faster: opcodes dispatched by their byte, one record shared by every leaf until something
can reach or change it, a stream read a window at a time instead of through ``pickletools.genops``.
Its verdicts are the scanner's before (kept below, condensed, as the reference): on pickles Python
writes (protocols 2 to 5: nested containers, tuple keys, sets, objects, values shared through the memo,
containers holding themselves), on random opcode programs (stacks too short, marks missing, memo
entries never stored, shared tuples doubling), every prefix of a pickle (a FormatError), and hostile
cases either side of each limit (depth, places, the places allowed per byte), in memory and as a stream
read in windows (lines and lengths across a window's edge, the stream left after the pickle's STOP).
"""

import collections
import dataclasses
import io
import pickle
import pickletools
import re
import struct
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from lightning_distckpt.core.errors import FormatError
from lightning_distckpt.storage.pickle_scan import (
    MAX_HASHED_DEPTH, MIN_PLACES, PLACES_PER_OPCODE, check_pickle, check_pickle_bytes)

# -- the scanner before (genops, a record object per object), condensed: the reference -------------------

_OLD_LEAVES = frozenset("INT BININT BININT1 BININT2 LONG LONG1 LONG4 STRING BINSTRING SHORT_BINSTRING BINBYTES "
                        "SHORT_BINBYTES BINBYTES8 BYTEARRAY8 NONE NEWTRUE NEWFALSE UNICODE SHORT_BINUNICODE "
                        "BINUNICODE BINUNICODE8 FLOAT BINFLOAT GLOBAL PERSID EXT1 EXT2 EXT4 NEXT_BUFFER "
                        "EMPTY_TUPLE".split())
_TAKES = {"TUPLE1": 1, "TUPLE2": 2, "TUPLE3": 3, "REDUCE": 2, "NEWOBJ": 2, "NEWOBJ_EX": 3, "APPEND": 1, "SETITEM": 2}
_WHAT = {"TUPLE": "a tuple", "FROZENSET": "a set", "INST": "a constructed object", "OBJ": "a constructed object"}


class _Refused(Exception):
    pass


class _R:
    __slots__ = ("depth", "places", "kids", "captured")

    def __init__(self, kids=None, tuple_=False):
        self.kids, self.captured, self.depth, self.places = kids if tuple_ else None, False, 1, 1
        self.add(kids or [])

    def add(self, kids):
        for kid in kids:
            self.depth, self.places = max(self.depth, kid.depth + 1), self.places + kid.places


def _old_verdict(data: bytes) -> tuple:
    limit = max(MIN_PLACES, PLACES_PER_OPCODE * len(data))
    stack, marks, memo = [], [], {}

    def hashed(records, what):
        for r in records:
            if r.depth > MAX_HASHED_DEPTH or r.places > limit:
                raise _Refused("refused", what, r.depth, r.places)

    def made(kids, what):
        record = _R([_R(k.kids, True) if k.kids is not None else k for k in kids], tuple_=what == "a tuple")
        hashed([record], what)
        for kid in kids:
            kid.captured = True
        return record

    def pop_mark():
        at = marks.pop()
        items = stack[at:]
        del stack[at:]
        return items

    try:
        for op, arg, _ in pickletools.genops(data):
            name = op.name
            if name in ("BINGET", "LONG_BINGET", "GET"):
                stack.append(memo[arg])
            elif name in ("BINPUT", "LONG_BINPUT", "PUT", "MEMOIZE"):
                memo[len(memo) if name == "MEMOIZE" else arg] = stack[-1]
            elif name in _OLD_LEAVES:
                stack.append(_R([], tuple_=name == "EMPTY_TUPLE"))
            elif name in ("EMPTY_LIST", "EMPTY_DICT", "EMPTY_SET"):
                stack.append(_R())
            elif name in ("BINPERSID", "READONLY_BUFFER"):
                stack[-1] = _R()
            elif name == "STACK_GLOBAL":
                del stack[-2:]
                stack.append(_R())
            elif name in _TAKES or name in ("APPENDS", "SETITEMS", "ADDITEMS") or name in _WHAT:
                n = _TAKES.get(name)
                items = pop_mark() if n is None else stack[-n:]
                if n is not None:
                    del stack[-n:]
                if name in ("APPEND", "APPENDS", "SETITEM", "SETITEMS", "ADDITEMS"):
                    if name != "APPEND" and name != "APPENDS":
                        hashed(items if name == "ADDITEMS" else items[::2],
                               "a set's item" if name == "ADDITEMS" else "a dict key")
                    stack[-1].add(items)
                else:
                    if name == "FROZENSET":
                        hashed(items, "a set's item")
                    stack.append(made(items, _WHAT.get(name, "a tuple" if name.startswith("TUPLE")
                                                       else "a constructor's arguments")))
            elif name in ("LIST", "DICT"):
                items = pop_mark()
                if name == "DICT":
                    hashed(items[::2], "a dict key")
                stack.append(_R(items))
            elif name == "BUILD":
                state = stack.pop()
                before = stack[-1].depth
                stack[-1].add([state])
                if stack[-1].captured and stack[-1].depth > before:
                    raise _Refused("captured")
                hashed([stack[-1]], "a constructed object")
            elif name in ("MARK", "POP", "POP_MARK", "DUP"):
                if name == "MARK":
                    marks.append(len(stack))
                else:
                    pop_mark() if name == "POP_MARK" else stack.append(stack[-1]) if name == "DUP" else stack.pop()
            elif name not in ("PROTO", "FRAME", "STOP"):
                raise ValueError(name)
    except _Refused as e:
        return e.args
    except (ValueError, IndexError, KeyError, EOFError):
        return ("malformed",)
    return ("ok",)


# -- the scanner now ----------------------------------------------------------------------------------------

_REFUSAL = re.compile(r"^x: (.+?) nested (\d+) deep and reaching (\d+) places \(at most")


def _verdict_of(call) -> tuple:
    try:
        call()
    except FormatError as e:
        found = _REFUSAL.search(str(e))
        if found:
            return ("refused", found[1], int(found[2]), int(found[3]))
        return ("captured",) if "after a tuple took it" in str(e) else ("malformed",)
    return ("ok",)


def _stop(data: bytes) -> int:
    return [pos for _, _, pos in pickletools.genops(data)][-1] + 1


def _verdicts(data: bytes, before: bytes = b"") -> tuple:
    """The in-memory scan's verdict, which the stream scan (``before`` ahead of it) must equal; a stream
    that passes is left after the pickle's STOP."""
    got = _verdict_of(lambda: check_pickle_bytes(data, "x"))
    f = io.BytesIO(before + data)
    f.seek(len(before))
    assert _verdict_of(lambda: check_pickle(f, "x", len(data))) == got
    if got == ("ok",):
        assert f.tell() == len(before) + _stop(data)
    return got


# -- pickles Python writes ----------------------------------------------------------------------------------

class _Obj:  # NEWOBJ (or REDUCE) and BUILD of its fields
    def __init__(self, **fields: Any) -> None:
        self.__dict__.update(fields)

    def __repr__(self) -> str:  # what it shares shown once (hypothesis shows a failing example's value)
        return f"_Obj({', '.join(self.__dict__)})"


@dataclasses.dataclass(frozen=True)
class _Key:  # a frozen dataclass hashes its fields: a dict key made by a constructor
    a: Any
    b: Any


_LEAF = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=False),
                  st.text(max_size=4), st.binary(max_size=4))
_HASHABLE = st.recursive(_LEAF, lambda kids: st.one_of(
    st.tuples(kids), st.tuples(kids, kids), st.lists(kids, max_size=5).map(tuple), st.frozensets(kids, max_size=3),
    st.builds(_Key, kids, kids)), max_leaves=12)


def _shared(value: Any) -> Any:
    """``value`` reached several times (memo entries), and a list and a dict holding themselves, in an object
    (shown briefly)."""
    loop, itself = [value], {"v": value}
    loop += [loop, value] + [value] * 6 + [loop]  # more than a few items, itself among them: counted in turn
    itself["me"] = itself
    return _Obj(shared=[value, (value, value), {"again": value}, loop, itself, [loop] * 9 + [value]])


_VALUE = st.recursive(_HASHABLE, lambda kids: st.one_of(
    st.lists(kids, max_size=12), st.tuples(kids, kids, kids), st.dictionaries(_HASHABLE, kids, max_size=10),
    st.sets(_HASHABLE, max_size=4), st.builds(lambda a, b: _Obj(a=a, b=b), kids, kids), kids.map(_shared),
    st.dictionaries(st.text(max_size=3), kids, max_size=4).map(collections.OrderedDict)), max_leaves=40)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(value=_VALUE, protocol=st.integers(2, 5))
def test_pickles_python_writes_get_the_verdicts_they_got_before(value, protocol):
    data = pickle.dumps(value, protocol=protocol)
    assert _verdicts(data) == _old_verdict(data), data[:400]


def test_an_object_holding_itself_in_a_tuple_is_refused_as_before():
    """BUILD fills in an object a tuple of its own state already took: refused before and now."""
    obj = _Obj()
    obj.me = (obj, obj)
    for protocol in (2, 5):
        data = pickle.dumps(obj, protocol=protocol)
        assert _verdicts(data) == _old_verdict(data) == ("captured",)


# -- random opcode programs ---------------------------------------------------------------------------------

# opcodes by what they need on the stack (``takes`` items above the last MARK; -1: a MARK) and leave
_PUSH = [b"K\x01", b"N", b")", b"}", b"]", b"\x8f", b"X\x01\x00\x00\x00a", b"\x8c\x02ab", b"T\x02\x00\x00\x00ab",
         b"\x8a\x01\x05", b"cmod\nname\n", b"I12\n", b"Vab\n", b"\x8e\x01" + bytes(7) + b"z", b"G" + bytes(8),
         b"]" + b"]a" * 500]  # lists nested 501 deep
_NEEDS = {  # opcode: (items it takes, items it leaves)
    b"\x85": (1, 1), b"\x86": (2, 1), b"\x87": (3, 1), b"a": (2, 1), b"s": (3, 1), b"b": (2, 1), b"R": (2, 1),
    b"\x81": (2, 1), b"\x92": (3, 1), b"\x93": (2, 1), b"2": (1, 2), b"0": (1, 0), b"\x94": (1, 1), b"Q": (1, 1),
    b"2\x86" * 6: (1, 1), b"2a" * 6: (1, 1), b"\x85" * 400: (1, 1),  # six doublings (a tuple of it twice, a
    # list holding itself), 400 levels of 1-tuples
    b"t": (-1, 1), b"\x91": (-1, 1), b"l": (-1, 1), b"d": (-1, 1), b"o": (-1, 1), b"imod\nname\n": (-1, 1),
    b"u": (-1, 0), b"e": (-1, 0), b"\x90": (-1, 0), b"1": (-1, 0)}
_ANY = _PUSH + list(_NEEDS) + [b"(", b"q\x00", b"h\x00", b"h\x07"]


@st.composite
def _programs(draw) -> bytes:
    """Opcodes the stack as it stands allows, mostly (one in twenty any: a stack too short, a MARK
    missing, a memo entry never stored), among them memo entries set and read again (BINPUT, LONG_BINPUT,
    PUT; BINGET, LONG_BINGET, GET) and MEMOIZE."""
    out, stack, memo = [draw(st.sampled_from([b"\x80\x02", b"\x80\x04", b""]))], [], 0  # stack: None a MARK
    for _ in range(draw(st.integers(0, 50))):
        mark = len(stack) - 1 - stack[::-1].index(None) if None in stack else -1  # the last MARK's index
        top = len(stack) - mark - 1  # items above it
        ops = _PUSH + [b"("] + [op for op, (takes, _) in _NEEDS.items() if takes <= top and (takes >= 0 or mark >= 0)]
        ops += [b"put"] * (top > 0) + [b"get"] * (memo > 0)
        op = draw(st.sampled_from(_ANY if draw(st.integers(0, 19)) == 0 else ops))
        if op == b"put":
            op = draw(st.sampled_from([b"q" + bytes([memo]), b"r" + struct.pack("<I", memo), b"p%d\n" % memo]))
            memo += 1
        elif op == b"get":
            index = draw(st.integers(0, memo - 1))
            op = draw(st.sampled_from([b"h" + bytes([index]), b"j" + struct.pack("<I", index), b"g%d\n" % index]))
        memo += op == b"\x94"
        takes, leaves = _NEEDS.get(op, (None, 0))
        if op == b"(":
            stack.append(None)
        elif op in _PUSH or op[:1] in b"hjg":
            stack.append(1)
        elif takes is not None and takes <= top and (takes >= 0 or mark >= 0):
            del stack[mark if takes < 0 else len(stack) - takes:]
            stack += [1] * leaves
        out.append(op)
    return b"".join(out) + b"."


@settings(max_examples=300, deadline=None)
@given(data=_programs())
def test_random_opcode_programs_get_the_verdicts_they_got_before(data):
    assert _verdicts(data, before=b"\x80\x02K\x01.") == _old_verdict(data)


def test_every_prefix_of_a_pickle_is_a_format_error():
    data = pickle.dumps({"a": [1, 2.5, "x" * 300, (1, 2)], (1, (2,)): {3}, "o": _Obj(b=b"\0" * 70)}, protocol=2)
    for cut in range(len(data)):
        assert _verdicts(data[:cut]) == _old_verdict(data[:cut]) == ("malformed",), cut
    for bad in (b"\x80\x02\xff.", b"\x80\x02h\x07.", b"\x80\x02T\xff\xff\xff\xff.", b"\x80\x02\x8b\xff\xff\xff\xff."):
        assert _verdicts(bad) == ("malformed",), bad


# -- either side of each limit ------------------------------------------------------------------------------

def _deep_key(levels: int) -> bytes:
    return b"\x80\x02})" + b"\x85" * levels + b"K\x01s."


def _laughing(doublings: int, padding: int = 0) -> bytes:
    """x = (x, x) ``doublings`` times from (1, 2) as a dict key: 2 ** (doublings + 2) - 1 places; a string
    of ``padding`` bytes beside it raises the limit (places allowed per byte)."""
    pad = b"X" + struct.pack("<I", padding) + b"p" * padding + b"0" if padding else b""
    return b"\x80\x02" + pad + b"}K\x01K\x02\x86q\x00" + b"h\x00\x86q\x00" * doublings + b"K\x01s."


@pytest.mark.parametrize("data,expected", [
    (_deep_key(MAX_HASHED_DEPTH - 1), ("ok",)),
    (_deep_key(MAX_HASHED_DEPTH), ("refused", "a tuple", MAX_HASHED_DEPTH + 1, MAX_HASHED_DEPTH + 1)),
    # a list is no tuple: only as a dict key, a set's item or a constructor's argument is it hashed
    (b"\x80\x02}" + b"]" * (MAX_HASHED_DEPTH + 1) + b"a" * MAX_HASHED_DEPTH + b"K\x01s.",
     ("refused", "a dict key", MAX_HASHED_DEPTH + 1, MAX_HASHED_DEPTH + 1)),
    (b"\x80\x02}" + b"]" * MAX_HASHED_DEPTH + b"a" * (MAX_HASHED_DEPTH - 1) + b"K\x01s.", ("ok",)),
    (b"\x80\x04\x8f(" + b"]" * (MAX_HASHED_DEPTH + 1) + b"a" * MAX_HASHED_DEPTH + b"\x90.",
     ("refused", "a set's item", MAX_HASHED_DEPTH + 1, MAX_HASHED_DEPTH + 1)),
    (b"\x80\x02cm\nf\n" + b"]" * MAX_HASHED_DEPTH + b"a" * (MAX_HASHED_DEPTH - 1) + b"R.",
     ("refused", "a constructor's arguments", MAX_HASHED_DEPTH + 1, MAX_HASHED_DEPTH + 2)),
    (b"\x80\x02cm\nf\n" + b"]" * (MAX_HASHED_DEPTH - 1) + b"a" * (MAX_HASHED_DEPTH - 2) + b"R.", ("ok",)),
    # a tuple holding a list filled in after the tuple was made: read again as a tuple takes the tuple
    (b"\x80\x02}]q\x00\x85q\x010h\x00" + b"]" * MAX_HASHED_DEPTH + b"a" * MAX_HASHED_DEPTH + b"0h\x01\x85K\x01s.",
     ("refused", "a tuple", MAX_HASHED_DEPTH + 3, MAX_HASHED_DEPTH + 3)),
    # an object (2 deep: its class, its arguments) a tuple took, filled in after (BUILD): one level deeper
    (b"\x80\x02cm\nf\n)\x81q\x00h\x00\x85q\x010]K\x01ab.", ("captured",)),
    (b"\x80\x02cm\nf\n)\x81q\x00h\x00\x85q\x010Nb.", ("ok",)),
    (_laughing(18), ("ok",)),
    (_laughing(19), ("refused", "a tuple", 21, 2**21 - 1)),
    (_laughing(19, padding=(2**21) // PLACES_PER_OPCODE), ("ok",)),  # the limit is 16 places a byte
    (_laughing(20, padding=(2**21) // PLACES_PER_OPCODE), ("refused", "a tuple", 22, 2**22 - 1)),
])
def test_hostile_pickles_either_side_of_each_limit(data, expected):
    assert _verdicts(data) == _old_verdict(data) == expected


# -- a stream read in windows -------------------------------------------------------------------------------

@pytest.mark.parametrize("protocol", [0, 2, 4])
def test_a_stream_longer_than_a_window_is_read_across_its_edges(protocol):
    """Strings of every length up to a few hundred bytes (lines in protocol 0), a bytes value longer than
    a window (skipped, not read), runs of memo references, a deep key at the end: opcodes and their
    arguments across each window's edge."""
    strings = [str(i) * (i % 300) for i in range(1500)]
    value = {"s": strings, "blob": b"\1" * 300_000, "key": {(((((1,),),),),): 1},
             "shared": [(i, i) for i in range(500)], "again": strings[:600] * 40}  # memo entries, 2 and 5 bytes
    data = pickle.dumps(value, protocol=protocol)
    assert _verdicts(data, before=b"\x80\x02K\x01.") == _old_verdict(data) == ("ok",)
    deep = data[:-1] + b"0" + _deep_key(MAX_HASHED_DEPTH)[2:]  # the dict popped, a deep key after it
    assert _verdicts(deep) == _old_verdict(deep) == ("refused", "a tuple", 1001, 1001)


@pytest.mark.parametrize("protocol", [2, 5])
def test_opcodes_across_the_first_window_edge_at_every_alignment(protocol):
    """Memo references of 2 and 5 bytes (protocol 2), bytearrays' 9-byte headers (protocol 5): the first
    window's edge falls on each byte of them as the bytes ahead of them grow."""
    names = [f"n{i}" for i in range(300)]
    dense = names * 100 if protocol == 2 else [bytearray(b"x" * (i % 5)) for i in range(7000)]
    for shift in range(12):
        data = pickle.dumps(["p" * shift, names, dense], protocol=protocol)
        assert _verdicts(data) == _old_verdict(data) == ("ok",), shift


class _CountingReader(io.BytesIO):
    """A file whose reads are counted (what a claimed length makes the scan read)."""

    read_bytes = 0

    def read(self, n=-1):
        got = super().read(n)
        self.read_bytes += len(got)
        return got


def test_a_length_claiming_more_than_the_stream_holds_reads_nothing_more():
    for op in (b"\x8e" + struct.pack("<Q", 1 << 62), b"X\xff\xff\xff\xff", b"\x8b\xff\xff\xff\x7f"):
        f = _CountingReader(b"\x80\x04" + op + b"abc" + bytes(200_000))
        with pytest.raises(FormatError, match="not a readable pickle"):
            check_pickle(f, "x", len(f.getvalue()))
        assert f.read_bytes <= 1 << 16, op
    f = _CountingReader(pickle.dumps(b"\1" * 3_000_000, protocol=4) + bytes(100))  # a long value: skipped
    check_pickle(f, "x", len(f.getvalue()))
    assert f.tell() == len(f.getvalue()) - 100 and f.read_bytes < 1 << 18
