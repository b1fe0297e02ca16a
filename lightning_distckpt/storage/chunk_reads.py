"""Reading stored chunks into their destinations on a few threads: each chunk ``preadv``'d
straight into the destination's own memory when it is wanted whole (else through one bounded
scratch buffer) and its CRC-32C computed over those bytes, piece by piece while they are still in
the CPU's cache (:data:`.chunk_checksums.crc32c`). Where the chunks are and how an array is cut
into them is :mod:`.direct_read`'s business; this module only performs :class:`ChunkTask` s.

A :class:`ReadSession` takes tasks as they are planned, so the first chunks are on their way
while the reader still reads and checks the zarr.json of later arrays (a cold load of a few
hundred arrays: their metadata is read from the device too).
"""

from __future__ import annotations

import contextlib
import os
import struct
import threading
from concurrent.futures import Future, wait
from dataclasses import dataclass
from typing import Any, Dict, Iterable, Iterator, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np
import torch

from ..core.tensor_bytes import byte_view, numpy_view
from ..core.errors import FormatError
from .chunk_checksums import crc32c
from .paths import open_regular
from .workers import KeptWorkers

_CRC_TRAILER = struct.Struct("<I")
_PIECE_BYTES = 1 << 20  # read and checksum a chunk this much at a time
_ADVISE_BYTES = 4 << 20  # asked of the kernel's readahead per call
_POOLS: Dict[int, KeptWorkers] = {}  # reader threads by count, kept between loads (see _pool)
_POOLS_LOCK = threading.Lock()
_PREFETCH = KeptWorkers("ldc-prefetch", 1)  # advise_willneed's thread, kept too


def _pool(threads: int) -> KeptWorkers:
    """The kept reader threads of this size: a load used to start its own, and on a loaded machine
    each start waits for the new thread to be scheduled (tens of ms a load with a few ranks per core)."""
    with _POOLS_LOCK:
        pool = _POOLS.get(threads)
        if pool is None:
            pool = _POOLS[threads] = KeptWorkers(f"ldc-direct-read-{threads}", threads)
        return pool


class ChunkLocation(NamedTuple):
    """Where a stored chunk's bytes are: ``length`` bytes at ``offset`` of file ``path``."""

    path: str
    offset: int
    length: int


@dataclass(frozen=True)
class Geometry:
    """What a direct read needs to know of a stored array."""

    shape: Tuple[int, ...]
    dtype: str  # tensorstore's name, as ``ts_dtype`` gives for the matching torch dtype
    chunk_rows: int
    row_bytes: int
    checksum: bool  # each chunk ends with its CRC-32C (the ``crc32c`` codec, format 3)
    crcs: Optional[Tuple[int, ...]] = None  # or each chunk's CRC-32C is in the array's metadata (format 5)

    @property
    def chunk_bytes(self) -> int:
        """Bytes of one encoded chunk: whole rows (edge chunks padded) plus the checksum."""
        return self.chunk_rows * self.row_bytes + (4 if self.checksum else 0)


class ChunkTask(NamedTuple):
    """Read chunk number ``chunk`` and deliver ``rows`` (chunk-local) of it, ``trailing``-sliced,
    into ``dest`` (None: read and verify only), converted to its dtype. ``direct``: ``dest`` is the
    chunk's whole rows, contiguous, of the stored dtype: read into it in place."""

    where: str
    loc: ChunkLocation
    geo: Geometry
    rows: slice
    trailing: Tuple[slice, ...]
    dest: Optional[torch.Tensor]
    direct: bool
    chunk: int = 0


class ReadSession:
    """Chunk reads in progress on a :class:`DirectReader`'s threads: :meth:`submit` tasks as they
    are planned, :meth:`finish` waits for all of them (call it, on failures too: the threads write
    into the destinations until then)."""

    def __init__(self, reader: "DirectReader", verify: bool) -> None:
        self.reader, self.verify = reader, verify
        self.fds: Dict[str, int] = {}
        self.futures: List["Future[Any]"] = []
        self.errors: List[str] = []
        self.pool = _pool(reader.threads)

    def submit(self, tasks: Iterable[ChunkTask]) -> None:
        """Start reading ``tasks`` (a data file that cannot be opened is an error of its tasks)."""
        for t in tasks:
            fd = self.fds.get(t.loc.path)
            if fd is None:
                try:  # a regular file, never through a link, never waiting on a FIFO
                    fd = self.fds[t.loc.path] = open_regular(t.loc.path, "data file")
                except (OSError, FormatError) as e:
                    self.errors.append(f"{t.where}: cannot open a data file: {e}")
                    continue
            future = self.pool.submit(self.reader.run_task, t, fd, self.verify)
            if future is None:  # interpreter shutdown: read it here
                future = Future()
                try:
                    future.set_result(self.reader.run_task(t, fd, self.verify))
                except BaseException as e:  # raised by finish(), as from a thread
                    future.set_exception(e)
            self.futures.append(future)

    def finish(self) -> Tuple[int, List[str]]:
        """(bytes delivered, an error message per failed chunk), once every read has ended."""
        try:
            wait(self.futures)
        finally:
            for fd in self.fds.values():
                os.close(fd)
            self.fds.clear()
        outcomes = [f.result() for f in self.futures]
        self.errors += [o for o in outcomes if isinstance(o, str)]
        return sum(o for o in outcomes if isinstance(o, int)), self.errors


class _Budget:
    """Bytes of scratch buffers in use at once, at most ``limit`` (one request alone may exceed it)."""

    def __init__(self, limit: int) -> None:
        self.limit, self.used, self.peak = limit, 0, 0
        self.cond = threading.Condition()

    @contextlib.contextmanager
    def take(self, nbytes: int) -> Iterator[None]:
        with self.cond:
            self.cond.wait_for(lambda: self.used == 0 or self.used + nbytes <= self.limit)
            self.used += nbytes
            self.peak = max(self.peak, self.used)
        try:
            yield
        finally:
            with self.cond:
                self.used -= nbytes
                self.cond.notify_all()


class DirectReader:
    """Runs :class:`ChunkTask` s on a few threads (``preadv`` and the checksum release the GIL).
    Chunks read in part go through scratch buffers, at most ``scratch_bytes`` of them at once."""

    def __init__(self, threads: int, scratch_bytes: int = 256 << 20) -> None:
        self.threads = max(1, threads)
        self.budget = _Budget(scratch_bytes)

    def start(self, verify: bool = True) -> ReadSession:
        """A session taking tasks as they come (:class:`ReadSession`)."""
        return ReadSession(self, verify)

    def run(self, tasks: Sequence[ChunkTask], verify: bool = True) -> Tuple[int, List[str]]:
        """(bytes delivered, an error message per failed chunk) of ``tasks``."""
        session = self.start(verify)
        try:
            session.submit(tasks)
        finally:
            outcome = session.finish()
        return outcome

    def run_task(self, task: ChunkTask, fd: int, verify: bool) -> Any:
        """Bytes delivered, or an error message (on a reader thread)."""
        if task.direct:
            return _run_one(task, fd, verify)
        with self.budget.take(task.geo.chunk_bytes):
            return _run_one(task, fd, verify)


def _run_one(task: ChunkTask, fd: int, verify: bool) -> Any:
    """Bytes delivered, or an error message."""
    geo, loc = task.geo, task.loc
    if loc.length != geo.chunk_bytes:
        return f"{task.where}: stored as {loc.length} bytes in {loc.path}, expected {geo.chunk_bytes} (damaged)"
    if task.dest is not None and task.direct:
        body = numpy_view(byte_view(task.dest))  # not view(-1): a one-element dest may have any stride
        parts = [body, np.empty(geo.chunk_rows * geo.row_bytes - body.nbytes, dtype=np.uint8)]  # + edge padding
    else:
        body = np.empty(geo.chunk_rows * geo.row_bytes, dtype=np.uint8)
        parts = [body]
    crc, offset = 0, loc.offset
    for part in parts:
        # Piece by piece, each checksummed while still in the CPU's cache (one pass over memory, not two)
        for start in range(0, part.nbytes, _PIECE_BYTES):
            piece = part[start:start + _PIECE_BYTES]
            try:
                got = os.preadv(fd, [piece], offset)
            except OSError as e:
                return f"{task.where}: reading {loc.path} failed: {e}"
            if got != piece.nbytes:
                return f"{task.where}: {loc.path} is truncated (chunk of {loc.length} bytes at offset {loc.offset})"
            offset += got
            if verify and (geo.checksum or geo.crcs is not None):
                crc = crc32c(piece, crc)
    stored: Optional[int] = None if geo.crcs is None else geo.crcs[task.chunk]
    if geo.checksum:
        trailer = os.pread(fd, 4, offset)
        if len(trailer) != 4:
            return f"{task.where}: {loc.path} is truncated (chunk of {loc.length} bytes at offset {loc.offset})"
        stored = _CRC_TRAILER.unpack(trailer)[0]
    if verify and stored is not None and crc != stored:
        return (f"{task.where}: checksum mismatch in {loc.path} at offset {loc.offset} (CRC-32C {crc:#010x}, "
                f"{'recorded in its zarr.json' if geo.crcs is not None else 'stored'} {stored:#010x}): damaged")
    if task.dest is None:  # checked only
        return loc.length
    if not task.direct:
        rows = torch.frombuffer(body, dtype=torch_dtype(geo.dtype)).view(geo.chunk_rows, *geo.shape[1:])
        task.dest.copy_(rows[(task.rows, *task.trailing)])
    return task.dest.numel() * task.dest.element_size()


def advise_willneed(ranges: Sequence[ChunkLocation]) -> None:
    """Ask the kernel to start reading ``ranges`` into the page cache, in this order
    (``posix_fadvise(POSIX_FADV_WILLNEED)``: it queues the reads and does not wait for them), on a
    thread of its own, so that the device is busy while a load still reads metadata and plans its
    reads; the reads that follow find the bytes there or on their way. Best effort: a file that
    cannot be opened (or a platform without ``posix_fadvise``) is skipped; the reads themselves
    report what is wrong."""
    if ranges and hasattr(os, "posix_fadvise"):
        _PREFETCH.submit(_advise, list(ranges))  # None at interpreter shutdown: no hint then


def _advise(ranges: List[ChunkLocation]) -> None:
    fds: Dict[str, Optional[int]] = {}
    try:
        for r in ranges:
            if r.path not in fds:
                try:  # a regular file, never through a link, never waiting on a FIFO
                    fds[r.path] = open_regular(r.path, "data file")
                except (OSError, FormatError):
                    fds[r.path] = None
            fd = fds[r.path]
            # The kernel starts at most its readahead size (a few MiB) per call: ask piece by piece
            for offset in range(r.offset, r.offset + r.length, _ADVISE_BYTES) if fd is not None else ():
                with contextlib.suppress(OSError):
                    os.posix_fadvise(fd, offset, min(_ADVISE_BYTES, r.offset + r.length - offset),
                                     os.POSIX_FADV_WILLNEED)
    finally:
        for fd in fds.values():
            if fd is not None:
                os.close(fd)


def torch_dtype(name: str) -> Optional[torch.dtype]:
    """The torch dtype of a tensorstore / zarr v3 dtype name, None where torch has none."""
    dtype = getattr(torch, name, None)
    return dtype if isinstance(dtype, torch.dtype) else None
