"""Checking a ``torch.save`` zip archive's records before torch reads them.

torch's archive reader takes each record's data offset from the record's local header (its name and
extra-field lengths) and reads it without checking the header's signature or the record's CRC-32
(with ``mmap=True`` it only slices the mapped file). A few damaged bytes in a local header therefore
shift a tensor's data and ``torch.load`` returns other bytes as its values. :func:`check_records` finds
every record through the zip directory as Python's :mod:`zipfile` parses it, checks its local header
(signature, the same name, the data inside the archive) and the CRC-32 of its bytes at the offset
torch will read them from. ``torch.save`` writes each record's CRC-32 unless told not to
(``torch.serialization.set_crc32_options(False)``: a CRC of 0, then only the header is checked).
"""

from __future__ import annotations

import io
import mmap
import os
import pickle
import struct
import zipfile
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any, BinaryIO, Dict, List

import torch

from ..core.errors import FormatError
from .checksums import verification_enabled
from .paths import INFLATED_FACTOR, INFLATED_FLOOR

try:  # ISA-L's CRC-32 (the zip polynomial): about 6x zlib's here (12.7 against 2.2 GB/s), the GIL released
    from isal.isal_zlib import crc32
except ImportError:  # a platform without isal's wheels
    from zlib import crc32

_LOCAL_HEADER = struct.Struct("<4s22sHH")  # signature, fixed fields, name length, extra length
_LOCAL_SIGNATURE = b"PK\x03\x04"
_UTF8_FLAG = 0x800
_DESCRIPTOR_FLAG = 0x8
_DESCRIPTOR_SIZES = (12, 16, 20, 24)  # CRC and sizes (32- or 64-bit), with or without a signature
#: above this many bytes of records the CRCs run on threads (both CRCs release the GIL), one record each
_PARALLEL_BYTES = 64 << 20


def check_records(source: Any, where: str) -> None:
    """Raise a FormatError naming the record unless every record of the zip archive ``source`` (a
    path, or a seekable binary file object such as ``io.BytesIO``) is intact where torch reads it:
    its local header (always) and its CRC-32 (unless ``LIGHTNING_DISTCKPT_VERIFY=0``)."""
    try:
        if isinstance(source, (str, os.PathLike)):
            with open(source, "rb") as f:
                _check_file(f, where)
        else:
            position = source.tell()
            try:
                _check_file(source, where)
            finally:
                source.seek(position)
    except (OSError, ValueError, OverflowError) as e:  # what a lying directory makes seek / mmap raise
        raise FormatError(f"{where}: not a readable zip archive: {type(e).__name__}: {e}") from None


def _check_file(f: BinaryIO, where: str) -> None:
    try:
        archive = zipfile.ZipFile(f)
    # NotImplementedError: zipfile's answer to a directory entry claiming a zip version past 6.3
    except (zipfile.BadZipFile, NotImplementedError, ValueError, OSError, EOFError) as e:
        raise FormatError(f"{where}: not a readable torch.save archive: its zip directory cannot be read (cut "
                          f"short or damaged): {e}") from None
    infos = archive.infolist()
    names = [i.filename for i in infos]
    if len(set(names)) != len(names):  # readers disagree on which of two records of a name counts
        raise FormatError(f"{where}: the zip archive names a record twice")
    size = f.seek(0, io.SEEK_END)
    after = following(archive)
    starts = [data_start(f, info, after[info.header_offset], size, where) for info in infos]
    compressed = [i for i in infos if i.compress_type != zipfile.ZIP_STORED]
    _check_inflated_size(compressed, size, where)  # checks or not: torch would inflate them
    if not verification_enabled():
        return
    stored = [(info, start) for info, start in zip(infos, starts) if info.compress_type == zipfile.ZIP_STORED]
    with _buffer(f) as buf:
        jobs = [(info, buf[start:start + info.file_size]) for info, start in stored if info.CRC or not info.file_size]
        total = sum(len(view) for _, view in jobs)
        if total > _PARALLEL_BYTES and len(jobs) > 1:
            with ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as pool:
                crcs = list(pool.map(lambda job: crc32(job[1]), jobs))
        else:
            crcs = [crc32(view) for _, view in jobs]
        bad = [info.filename for (info, _), crc in zip(jobs, crcs) if crc != info.CRC]
        del jobs  # the views, before the mapping closes
    if bad:
        raise FormatError(f"{where}: zip record {bad[0]!r} is damaged: its bytes do not match its CRC-32")
    for info in compressed:  # (torch writes none) zipfile inflates and checks them, a block at a time
        try:
            with archive.open(info) as record:
                while record.read(1 << 24):
                    pass
        except (zipfile.BadZipFile, NotImplementedError, ValueError, OSError, EOFError, zlib.error) as e:
            raise FormatError(f"{where}: zip record {info.filename!r} is damaged: {e}") from None


def _check_inflated_size(compressed: List[zipfile.ZipInfo], size: int, where: str) -> None:
    """The compressed records' inflated sizes, as the directory declares them (torch allocates that
    much for each, zipfile stops there), at most :data:`INFLATED_FACTOR` x the archive's ``size`` or
    :data:`INFLATED_FLOOR` in all: a few MB of deflated zeros would inflate to all the memory there is."""
    budget = max(INFLATED_FACTOR * size, INFLATED_FLOOR)
    declared = sum(i.file_size for i in compressed)
    if declared > budget:
        raise FormatError(f"{where}: its compressed zip records inflate to {declared} bytes, more than the {budget} "
                          f"a torch file of {size} bytes may (max({INFLATED_FACTOR} x its size, {INFLATED_FLOOR})): "
                          f"a decompression bomb, or damaged")


def following(archive: zipfile.ZipFile) -> Dict[int, int]:
    """For each record's local header offset, where what follows its record begins: the next
    record's local header, or the zip directory."""
    offsets = sorted({i.header_offset for i in archive.infolist()})
    return dict(zip(offsets, offsets[1:] + [archive.start_dir]))


def data_start(f: BinaryIO, info: zipfile.ZipInfo, next_offset: int, size: int, where: str) -> int:
    """The offset of the record's data, from its local header as torch reads it, once the header is
    checked: its signature, the directory's name, and its data ending where what follows begins
    (after a data descriptor where its flags say so, as ``torch.save`` writes them), so that a
    damaged name or extra-field length cannot shift the data, even where no CRC is checked."""
    if not 0 <= info.header_offset < size:  # zipfile shifts offsets by bytes it finds before the archive
        raise FormatError(f"{where}: zip record {info.filename!r}: its local header lies outside the archive")
    f.seek(info.header_offset)
    head = f.read(_LOCAL_HEADER.size)
    if len(head) != _LOCAL_HEADER.size:
        raise FormatError(f"{where}: zip record {info.filename!r}: its local header lies past the end")
    signature, _, name_len, extra_len = _LOCAL_HEADER.unpack(head)
    raw_name = f.read(name_len)
    encoding = "utf-8" if info.flag_bits & _UTF8_FLAG else "cp437"
    start = info.header_offset + _LOCAL_HEADER.size + name_len + extra_len
    gap = next_offset - (start + info.compress_size)
    if signature != _LOCAL_SIGNATURE or raw_name.decode(encoding, "replace") != info.orig_filename or \
            gap not in (_DESCRIPTOR_SIZES if info.flag_bits & _DESCRIPTOR_FLAG else (0,)):
        raise FormatError(f"{where}: zip record {info.filename!r}: damaged local header")
    if start + info.compress_size > size:
        raise FormatError(f"{where}: zip record {info.filename!r} runs past the end of the archive")
    return start


def check_storage_sizes(path: str, where: str) -> bool:
    """Refuse a ``torch.save`` archive whose ``data.pkl`` claims for a storage another size than
    its record holds. torch's memory-mapped load (``mmap=True``, as ``load_file`` reads) takes the
    claimed bytes from the record's start unchecked (its unmapped load checks: "record size does
    not match"), so a claim past the record loaded the next records, local headers and zip directory
    as the tensor's values. ``data.pkl`` is replayed with torch's weights-only unpickler, each
    storage left on the meta device (no tensor data read); call it while the load's types are
    allowed, after :func:`check_records`. False: the replay could not finish on the meta device (a
    nested tensor has no meta form), so nothing is known, or a storage's data does not start at a
    multiple of its element size (``torch.save`` under ``storage_alignment`` 1: mapped, torch's
    kernels read it misaligned, and a complex128 copy crashed the process): load the file unmapped,
    where torch checks the sizes and copies the data into aligned memory."""
    from torch._weights_only_unpickler import Unpickler  # what torch.load(weights_only=True) runs

    with open(path, "rb") as f, zipfile.ZipFile(f) as archive:
        infos = archive.infolist()
        prefix = infos[0].filename.split("/")[0] if infos else ""  # torch's archive name: the first record's folder
        sizes = {i.filename: i.file_size for i in infos}
        if f"{prefix}/data.pkl" not in sizes:
            return True  # torch.load says what is missing
        pickled = _record_bytes(f, archive, archive.getinfo(f"{prefix}/data.pkl"), where)
        end, after = f.seek(0, io.SEEK_END), following(archive)
        starts = {i.filename: data_start(f, i, after[i.header_offset], end, where) for i in infos
                  if i.filename.startswith(f"{prefix}/data/")}
    misaligned = []

    def persistent_load(saved_id: Any) -> Any:  # torch's own, with a size check for the real load
        if not isinstance(saved_id, tuple) or len(saved_id) != 5:
            raise FormatError(f"{where}: data.pkl refers to a storage as {str(saved_id)[:100]}, not torch's "
                              "('storage', type, key, location, numel)")
        _, storage_type, key, _, numel = saved_id
        dtype = torch.uint8 if storage_type is torch.UntypedStorage else getattr(storage_type, "dtype", None)
        name = f"{prefix}/data/{key}"
        if isinstance(dtype, torch.dtype) and type(numel) is int and name in sizes:
            nbytes = numel * dtype.itemsize
            if nbytes != sizes[name]:
                raise FormatError(f"{where}: a tensor storage claims {numel} elements of {dtype} ({nbytes} bytes) but "
                                  f"its zip record {name!r} holds {sizes[name]} bytes: damaged or forged")
            if starts[name] % dtype.itemsize:  # a mapping is page-aligned: the data's address is misaligned too
                misaligned.append(name)
            storage = torch.UntypedStorage(nbytes, device="meta")
            return torch.storage.TypedStorage(wrap_storage=storage, dtype=dtype, _internal=True)
        raise FormatError(f"{where}: data.pkl refers to storage {str(key)[:100]!r} of type {storage_type!r:.100} "
                          f"and {str(numel)[:30]} elements, which the archive does not hold as torch.save writes it")

    unpickler = Unpickler(io.BytesIO(pickled), encoding="utf-8")
    unpickler.persistent_load = persistent_load  # type: ignore[method-assign]
    pending = _sparse_pending()
    before = len(pending)
    try:
        unpickler.load()
    except (FormatError, pickle.UnpicklingError):  # a lying claim; a type the real load refuses too
        raise
    except Exception:  # noqa: BLE001 - a rebuild without a meta form: the caller loads it unmapped
        return False
    finally:
        del pending[before:]  # this replay's meta sparse tensors: no torch.load of ours, nothing to validate
    return not misaligned


def _sparse_pending() -> List[Any]:
    """torch's list of the sparse tensors its unpickler rebuilt, which the ``torch.load`` running it checks
    (and empties) as it ends. The replay above is no ``torch.load``: the meta sparse tensors it left there were
    checked by the thread's next ``torch.load`` (ours after the replay, or a user's after our refusal), which
    failed copying meta data ("Cannot copy out of meta tensor") where torch checks them: with
    ``check_sparse_tensor_invariants`` on, and on every weights-only load from torch 2.14 (a thread-local
    list in later releases, a module global in 2.13 and 2.14)."""
    import torch._utils as tu

    get = getattr(tu, "_get_sparse_tensors_to_validate", None)
    pending = get() if get is not None else getattr(tu, "_sparse_tensors_to_validate", None)
    return pending if isinstance(pending, list) else []


def _record_bytes(f: BinaryIO, archive: zipfile.ZipFile, info: zipfile.ZipInfo, where: str) -> bytes:
    """A record's bytes as torch reads them: a stored one from its data offset, its CRC not
    checked (torch.save may write none: ``set_crc32_options(False)``; check_records checked the rest)."""
    if info.compress_type != zipfile.ZIP_STORED:
        return archive.read(info)
    size = f.seek(0, io.SEEK_END)
    f.seek(data_start(f, info, following(archive)[info.header_offset], size, where))
    return f.read(info.file_size)


class _buffer:
    """The file's bytes as one buffer: a BytesIO's value, else a read-only mapping of the file."""

    def __init__(self, f: BinaryIO) -> None:
        self._f = f
        self._map: Any = None
        self._view = memoryview(b"")

    def __enter__(self) -> memoryview:
        if isinstance(self._f, io.BytesIO):
            self._view = memoryview(self._f.getvalue())  # shares a BytesIO's bytes; getbuffer() would copy them
        elif self._f.seek(0, io.SEEK_END):
            self._map = mmap.mmap(self._f.fileno(), 0, access=mmap.ACCESS_READ)
            self._view = memoryview(self._map)
        return self._view

    def __exit__(self, *exc: Any) -> None:
        self._view.release()  # (the slices taken of it are gone: a mapping with exports cannot close)
        if self._map is not None:
            self._map.close()

