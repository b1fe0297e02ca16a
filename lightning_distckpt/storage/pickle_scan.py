"""A pickle's opcodes read, before it is loaded, for what loading it would hash without bound.

Loading a pickle hashes what it builds: a dict's keys, a set's items, a constructor's arguments
(``set``, ``dict``, ``OrderedDict``, and frozen dataclasses such as DCP's ``MetadataIndex`` hash
theirs). Python hashes a tuple by recursing into it in C, past the interpreter's recursion limit and
once per path: a dict key of 1-tuples nested 200,000 deep (a 200 KB ``common.pt``) crashed the
loading process (SIGSEGV), and one of shared tuples ``x = (x, x)`` 40 deep (1 KB) hashes 2**40 items
(hours). No later check (``core/tree_walk.py`` walks what was loaded) comes first.

For torch's unpickler (``common.pt``, ShardedObjects, torch files), which we cannot hook,
:func:`check_pickle_bytes` (a ``data.pkl`` in memory) and :func:`check_pickle` (the pre-1.6 stream)
follow the opcodes (:mod:`.pickle_opcodes`) with a record per object (how deep it nests, how many places
it reaches counted at every path: what hashing it visits), build nothing, and refuse, with a FormatError
naming the file, a tuple, frozenset or constructed object nested deeper than :data:`MAX_HASHED_DEPTH` or reaching more
than max(:data:`MIN_PLACES`, :data:`PLACES_PER_OPCODE` x its opcodes) places, a constructor's argument
or dict key or set item as deep, and an object filled in (``BUILD``) after a tuple took it. ``builtins.bytes``
passes only called with no argument (protocol 2's ``b""``; the loader allows that call and no other): any
other use is an UnsafeContentError, unless ``bytes_call_only=False`` (the user allowed the type). A pickle
that is no pickle (truncated, an unknown opcode, a length past its end) is a FormatError too: the reads
are bounded by the bytes present. Our own unpickler (DCP's ``.metadata``) calls :func:`check_hashed`
on the objects themselves before each hash.
"""

from __future__ import annotations

import contextlib
import io
from typing import Any, BinaryIO, Dict, List, Optional

from ..core.errors import FormatError
from ..core.gc_pause import gc_paused
from .pickle_opcodes import HEADER_BYTES, MAX_HASHED_DEPTH, MIN_PLACES, PLACES_PER_OPCODE, Scan, scan_opcodes


def check_pickle_bytes(data: bytes, where: str, bytes_call_only: bool = True) -> None:
    """:func:`check_pickle` of the one pickle at the start of ``data`` (in memory)."""
    scan = Scan(where, max(MIN_PLACES, PLACES_PER_OPCODE * len(data)), bytes_call_only)
    with gc_paused():  # a record per container, in no cycle: see gc_paused (half the scan's time otherwise)
        pos, stopped = scan_opcodes(scan, data, 0, len(data))
    if not stopped:
        raise FormatError(f"{where}: not a readable pickle (it ends before its STOP opcode: cut short at byte "
                          f"{min(pos, len(data))} of {len(data)}, or a length past its end)")


_WINDOW, _MAX_WINDOW = 1 << 16, 1 << 22  # a stream is read a window at a time: what a pickle's size is unknown


def check_pickle(f: BinaryIO, where: str, size: int, bytes_call_only: bool = True) -> None:
    """Scan the one pickle at ``f``'s position (``size`` bytes of it at most, read up to its STOP), as the
    module says; ``f`` is left after it. FormatError naming ``where`` when it is refused or no pickle. The
    bytes a string or bytes value holds past what was read are skipped, not read (a length claiming 4 GB
    in a short file reads nothing more)."""
    scan = Scan(where, max(MIN_PLACES, PLACES_PER_OPCODE * size), bytes_call_only)
    base = f.tell()  # where data[0] is; f is at base + len(data)
    stop, data, pos, window = base + size, b"", 0, _WINDOW
    while True:
        if pos > len(data):
            base, data, pos = base + pos, b"", 0
            f.seek(min(base, stop))
        more = f.read(max(0, min(window, stop - base - len(data))))
        data, base, pos = data[pos:] + more, base + pos, 0
        scan.offset = base
        last = not more or base + len(data) >= stop
        with gc_paused():
            pos, stopped = scan_opcodes(scan, data, 0, len(data) if last else len(data) - HEADER_BYTES)
        if stopped:
            f.seek(base + pos)
            return
        if last:
            raise FormatError(f"{where}: not a readable pickle (it ends before its STOP opcode: cut short at byte "
                              f"{min(base + pos, stop)}, or a length past its end)")
        window = min(2 * window, _MAX_WINDOW)


def check_archive_pickle(source: Any, where: str, bytes_call_only: bool = True) -> None:
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
                    check_pickle_bytes(_record_bytes(f, archive, info, where), what, bytes_call_only)
                    continue
                # whole, as torch reads it (inflation checked)
                check_pickle_bytes(archive.read(info), what, bytes_call_only)
    except (zipfile.BadZipFile, OSError, EOFError, RuntimeError) as e:  # check_records said what is wrong first
        raise FormatError(f"{where}: not a readable torch.save archive: {type(e).__name__}: {e}") from None
    finally:
        if position is not None:
            source.seek(position)


def check_stream_pickles(f: BinaryIO, where: str, count: int = 5, bytes_call_only: bool = True) -> None:
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
            check_pickle(f, where, end - f.tell(), bytes_call_only)
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
