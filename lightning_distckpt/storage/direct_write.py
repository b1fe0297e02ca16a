"""Chunk files written with ``O_DIRECT`` (the ``zarr`` layout on a local file system).

A buffered write copies every byte into the kernel's page cache, into pages it must first get:
on the VMs we measure on, 0.4-0.6 CPU-s per 200 MB written to a new file (memory handed back to
the host is faulted in again), against 0.05 for the copy itself; and that CPU is taken from
training while an async save runs. ``O_DIRECT`` moves the bytes from our buffer to the device
without the page cache: about 0.005 CPU-s per 200 MB (``benchmarks/bench_async_cpu.py``,
docs/benchmarks.md). The checkpoint's bytes are the same as tensorstore writes them (plain
chunks, the edge chunk padded with zeros to whole rows), so every reader reads them as before.

``O_DIRECT`` wants the memory address, file offset and length aligned to the device's block.
Pieces of the source that are aligned (a staging pool's buffers are) go to ``write`` as they
are; the rest are copied through one page-aligned bounce buffer per thread (a ``memcpy``, with the
GIL released), the edge padded with zeros, and the file cut to its size after. Each file is
fsync'd (its size and blocks; the data is already on the device). A file system that refuses
``O_DIRECT`` (tmpfs, some network file systems) is found once per device and written buffered by
tensorstore as before; ``LIGHTNING_DISTCKPT_DIRECT_WRITES=0`` turns this off process-wide.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import threading
from concurrent.futures import Future
from typing import Dict, List, Optional, Tuple

import numpy as np

from ..core.errors import naming_file
from .workers import KeptWorkers

DIRECT_WRITES_ENV = "LIGHTNING_DISTCKPT_DIRECT_WRITES"
ALIGN = 4096  # the largest logical block size in common use; a multiple of every smaller one
BLOCK = 8 * 1024 * 1024  # bytes per write call, and the bounce buffer's size
MIN_DIRECT_BYTES = 128 * 1024  # smaller arrays are packed (pack_max_bytes) or not worth a file of their own
_O_DIRECT = getattr(os, "O_DIRECT", 0)

THREADS = 4  # concurrent files: a device's queue wants a few writes in flight
_supported: Dict[int, bool] = {}  # st_dev -> whether O_DIRECT writes work there
_lock = threading.Lock()
_local = threading.local()
_POOL = KeptWorkers("distckpt-direct-write", THREADS)


def direct_writes_enabled(option: bool) -> bool:
    """The writer's ``direct_writes`` option, unless the environment turns it off."""
    return option and _O_DIRECT != 0 and os.environ.get(DIRECT_WRITES_ENV, "1") != "0"


def supported(directory: str) -> bool:
    """Whether files in ``directory`` (which exists) can be written with ``O_DIRECT``: probed once per
    device by writing one aligned block to a scratch file there (removed again)."""
    try:
        dev = os.stat(directory).st_dev
    except OSError:
        return False
    with _lock:
        if dev in _supported:
            return _supported[dev]
    probe = os.path.join(directory, f".direct-probe-{os.getpid()}-{threading.get_ident()}")
    ok = False
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_DIRECT | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, memoryview(_bounce())[:ALIGN])
            ok = True
        finally:
            os.close(fd)
    except OSError:
        ok = False  # EINVAL (tmpfs, overlay on some kernels), EOPNOTSUPP: written buffered
    finally:
        try:
            os.unlink(probe)
        except OSError:
            pass
    with _lock:
        _supported[dev] = ok
    return ok


def _bounce() -> mmap.mmap:
    """This thread's page-aligned bounce buffer (anonymous memory: aligned, zero-filled)."""
    buf = getattr(_local, "buf", None)
    if buf is None:
        buf = _local.buf = mmap.mmap(-1, BLOCK)
    return buf


def _address(buf: mmap.mmap) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


def _write_all(fd: int, data: memoryview, path: str) -> None:
    while len(data):
        n = os.write(fd, data)
        if n <= 0:
            raise OSError(errno.EIO, f"short write to {path}")
        data = data[n:]


def write_chunk_file(path: str, src: np.ndarray, size: int) -> None:
    """Write ``src`` (a C-contiguous byte array) to the new file ``path`` with ``O_DIRECT``, followed by
    zeros up to ``size`` bytes (zarr's edge chunk); fsync it. The file must not exist. An OSError
    names the file (a full disk at a write or the fsync would not)."""
    with naming_file(path):
        _write_chunk_file(path, src, size)


def _write_chunk_file(path: str, src: np.ndarray, size: int) -> None:
    nbytes = src.nbytes
    base = src.ctypes.data
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_DIRECT | os.O_CLOEXEC, 0o644)
    try:
        view = memoryview(src.reshape(-1).view(np.uint8)) if nbytes else memoryview(b"")
        written = 0
        while written < size:
            n = min(BLOCK, size - written)
            direct = written + n <= nbytes and (base + written) % ALIGN == 0 and n % ALIGN == 0
            if direct:  # the source itself is aligned here: no copy
                _write_all(fd, view[written:written + n], path)
            else:
                buf = _bounce()
                have = max(0, min(n, nbytes - written))
                if have:
                    ctypes.memmove(_address(buf), base + written, have)  # releases the GIL
                padded = -(-n // ALIGN) * ALIGN
                if padded > have:
                    ctypes.memset(_address(buf) + have, 0, padded - have)  # zarr's zero rows, and the pad
                _write_all(fd, memoryview(buf)[:padded], path)
            written += n
        if size % ALIGN:
            os.ftruncate(fd, size)  # the last write was padded to the block
        os.fsync(fd)
    finally:
        os.close(fd)


def chunk_files(array_dir: str, shape: Tuple[int, ...], chunk_rows: int,
                row_bytes: int) -> List[Tuple[str, int, int, int]]:
    """``(path, first byte, bytes of data, stored size)`` of each chunk file of an array at
    ``array_dir`` cut every ``chunk_rows`` rows (zarr v3 default key encoding, ``c/<i>/0/...``)."""
    rows = shape[0]
    step = chunk_rows * row_bytes
    out = []
    for i, first in enumerate(range(0, rows, chunk_rows)):
        key = "/".join(["c", str(i)] + ["0"] * (len(shape) - 1))
        start = first * row_bytes
        out.append((os.path.join(array_dir, key), start, min(step, rows * row_bytes - start), step))
    return out


def eligible(arr: np.ndarray) -> bool:
    """Arrays worth writing with ``O_DIRECT``: at least one axis and :data:`MIN_DIRECT_BYTES`."""
    return arr.ndim >= 1 and arr.nbytes >= MIN_DIRECT_BYTES and arr.flags.c_contiguous


def write_array_chunks(array_dir: str, arr: np.ndarray, chunk_rows: int) -> Optional[int]:
    """Write every chunk file of ``arr`` under ``array_dir`` (created); returns bytes written."""
    row_bytes = arr.nbytes // arr.shape[0]
    flat = arr.reshape(-1).view(np.uint8)
    made = set()
    for path, start, have, size in chunk_files(array_dir, arr.shape, chunk_rows, row_bytes):
        parent = os.path.dirname(path)
        if parent not in made:
            os.makedirs(parent, exist_ok=True)
            made.add(parent)
        write_chunk_file(path, flat[start:start + have], size)
    return arr.nbytes


def submit_array(array_dir: str, arr: np.ndarray, chunk_rows: int) -> "Future[Optional[int]]":
    """:func:`write_array_chunks` on one of the writer threads, at the caller's scheduling priority
    (an async save's background thread runs below the training: so do its writes)."""
    nice = _priority()
    future = _POOL.submit(_at_priority, nice, array_dir, arr, chunk_rows)
    if future is None:  # interpreter shutdown (an async save finishing at exit): on this thread
        future = Future()
        try:
            future.set_result(_at_priority(nice, array_dir, arr, chunk_rows))
        except BaseException as e:
            future.set_exception(e)
    return future


def _priority() -> int:
    try:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    except (OSError, AttributeError):
        return 0


def _at_priority(nice: int, array_dir: str, arr: np.ndarray, chunk_rows: int) -> Optional[int]:
    if _priority() < nice:  # lowered only: an unprivileged process cannot raise it back
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
        except OSError:
            pass
    return write_array_chunks(array_dir, arr, chunk_rows)
