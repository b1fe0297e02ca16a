"""Packed small shards: one 1-D array per writing rank and dtype holds the small shards (norms,
biases) of that rank back to back; each shard's element offset is in ``metadata.json``. How a pack
is built for writing and how a packed shard is seen when reading."""

from __future__ import annotations

import contextlib
import ctypes
import math
from typing import Any, Callable, Dict, Iterable, List, Sequence, Tuple

import ml_dtypes
import numpy as np
import tensorstore as ts
import torch

from ..core.tensor_bytes import numpy_view
from .base import ShardRead, ShardWrite


_SERIAL_COPY = 32768  # torch copies fewer elements than this on the calling thread (its GRAIN_SIZE)


def build_pack(dtype: torch.dtype, members: Sequence[ShardWrite]) -> np.ndarray:
    """One 1-D array holding every member's data at its planned element offset.

    Never a parallel torch copy: torch's copy of a slice above 32K elements wakes its thread pool,
    which on busy cores cost 20-40 ms a save where the copy itself takes 0.1 ms (issue 29). Small
    1-D members back to back (norms, biases: the usual pack) are one ``torch.cat`` (each piece
    copied on this thread, ~0.3 µs a member); anything else is copied member by member by numpy."""
    end = 0
    for w in members:  # back to back, 1-D and small? (plain Python on each shape: microseconds count here)
        shape = w.data.shape
        if w.packed != end or len(shape) != 1 or shape[0] >= _SERIAL_COPY:
            break
        end += shape[0]
    else:
        return source_numpy(torch.cat([w.data for w in members]))
    end = max(w.packed + w.data.numel() for w in members)  # type: ignore[operator]
    buf = to_numpy(torch.empty(end, dtype=dtype))
    for w in members:
        buf[w.packed:w.packed + w.data.numel()] = source_numpy(w.data).reshape(-1)  # type: ignore[operator]
    return buf


# dtypes numpy holds only through ml_dtypes: torch's ``numpy()`` and ``from_numpy`` refuse them, so
# their bytes cross as an integer type of their size (the numpy dtype, the integer torch views them as)
_ML_DTYPES: Dict[torch.dtype, Tuple[Any, torch.dtype]] = {
    torch.bfloat16: (ml_dtypes.bfloat16, torch.int16),
    torch.float8_e4m3fn: (ml_dtypes.float8_e4m3fn, torch.uint8),
    torch.float8_e5m2: (ml_dtypes.float8_e5m2, torch.uint8),
    torch.float8_e4m3fnuz: (ml_dtypes.float8_e4m3fnuz, torch.uint8),
    torch.float8_e5m2fnuz: (ml_dtypes.float8_e5m2fnuz, torch.uint8),
}
_ML_TORCH = {np.dtype(numpy_dtype): (dtype, np.int16 if via == torch.int16 else np.uint8)
             for dtype, (numpy_dtype, via) in _ML_DTYPES.items()}


def settle(futures: Iterable[Any]) -> None:
    """Wait for every one of ``futures`` (tensorstore's) to end, whatever its outcome: a read or write still
    running holds memory a caller may free or reuse once we raise (the caller's error is the one raised)."""
    for fut in futures:
        with contextlib.suppress(Exception):
            fut.result()


def as_tensor(arr: np.ndarray) -> torch.Tensor:
    """A torch view of a numpy array read from a store (bfloat16 and float8 included)."""
    ml = _ML_TORCH.get(arr.dtype)
    if ml is not None:
        return torch.from_numpy(arr.view(ml[1])).view(ml[0])
    return torch.from_numpy(arr)


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """A numpy view of a CPU tensor (bfloat16 and float8 as ml_dtypes' types), sharing memory (as_tensor's
    inverse)."""
    ml = _ML_DTYPES.get(t.dtype)
    if ml is not None:
        return numpy_view(t.view(ml[1])).view(ml[0])
    return numpy_view(t)  # not t.numpy(): the caller's tensor stays resizable


def source_numpy(t: torch.Tensor) -> np.ndarray:
    """:func:`to_numpy` of a tensor to write, contiguous: a lazy conjugate or negative bit (``z.conj()``,
    ``z.conj().imag``) resolved first, a copy (numpy has no such views; its values are the resolved ones)."""
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
    return to_numpy(t.contiguous())


def landing(stored: str, dest: torch.Tensor, casts: List[Tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """A tensor of dtype ``stored`` (a tensorstore name) shaped like ``dest``, for a read to land in
    before torch converts it into ``dest``; the pair is added to ``casts``. Not ``ts.cast``: tensorstore's
    conversions differ from ``Tensor.to`` on NaN payloads and float8 overflow (a float32 NaN or 1e6 into
    float8_e4m3fn), and a load converts every value as ``Tensor.to`` does, whichever way it is read."""
    into = torch.empty(dest.shape, dtype=getattr(torch, stored))
    casts.append((into, dest))
    return into


def packed_view(pack: Any, offset: int, shape: Tuple[int, ...]) -> Any:
    """A read view of ``prod(shape)`` elements of the 1-D ``pack`` from ``offset``, in ``shape``:
    element ``i`` (row-major) of the view is ``pack[offset + i]``. Reads past the pack's end fail."""
    numel = math.prod(shape)
    if not shape:
        return pack[offset]
    if len(shape) == 1:
        return pack[offset:offset + numel].translate_to[0]
    positions = np.arange(offset, offset + numel, dtype=np.int64).reshape(shape)
    return pack[ts.IndexTransform(input_shape=shape, output=[ts.OutputIndexMap(index_array=positions)])]


def pack_runs(reads: Sequence[Tuple[ShardRead, Tuple[str, int, Tuple[int, ...]]]],
              pack_array: Callable[[int, str], Any]) -> List[Any]:
    """Start one read per run of nearby packed shards of each pack (gaps under 1 MiB are read
    through, rather than fetching a pack's chunk again for every norm and bias). ``reads``: each
    read with its place (pack dtype, element offset, shard shape); ``pack_array(writer, dtype)``:
    the opened pack. Returns ``(what, future of the run's numpy array, [(start in run, shard
    shape, src, dest)])``: :func:`copy_out` puts a run's pieces in place."""
    by_pack: Dict[Tuple[int, str], List[Tuple[int, Tuple[int, ...], Any, torch.Tensor]]] = {}
    for r, (dtype, offset, shape) in reads:
        by_pack.setdefault((r.writer, dtype), []).append((offset, shape, r.src, r.dest))
    runs = []
    for (writer, dtype), items in by_pack.items():
        pack = pack_array(writer, dtype)
        gap = (1 << 20) // max(1, int(np.dtype(pack.dtype.numpy_dtype).itemsize))
        items.sort(key=lambda it: it[0])
        group: List[Any] = []
        lo = hi = 0
        for it in items + [None]:  # type: ignore[list-item]
            if it is not None and group and it[0] <= hi + gap:
                group.append(it)
                hi = max(hi, it[0] + math.prod(it[1]))
                continue
            if group:
                runs.append((f"reading packed {dtype} shards {lo}:{hi} of rank {writer}", pack[lo:hi].read(),
                             [(off - lo, shape, src, dest) for off, shape, src, dest in group]))
            if it is not None:
                group, lo, hi = [it], it[0], it[0] + math.prod(it[1])
    return runs


_WHOLE: Dict[Tuple[int, ...], Tuple[slice, ...]] = {}


def _whole(shape: Tuple[int, ...]) -> Tuple[slice, ...]:
    """The ``src`` that selects all of a shard of ``shape`` (as reads name it), remembered per shape."""
    whole = _WHOLE.get(shape)
    if whole is None:
        whole = _WHOLE.setdefault(tuple(shape), tuple(slice(0, n) for n in shape))
    return whole


def copy_out(run: np.ndarray, pieces: Sequence[Tuple[int, Tuple[int, ...], Any, torch.Tensor]]) -> int:
    """Copy each piece ``(start in run, shard shape, src, dest)`` of a run read from a pack into its
    destination (converted to its dtype); returns bytes. Same dtype: by numpy (about 1 µs a piece,
    where torch's indexing and copy cost several: thousands of norms and biases per load)."""
    nbytes = 0
    flat = as_tensor(run)
    base, size = (run.ctypes.data, run.itemsize) if run.size and run.flags.c_contiguous else (None, 0)
    for start, shape, src, dest in pieces:
        numel = math.prod(shape)
        if dest.dtype == flat.dtype:
            if (base is not None and numel and src == _whole(shape) and dest.device.type == "cpu"
                    and dest.is_contiguous() and not (dest.is_neg() or dest.is_conj())):
                # the piece's bytes as they are, by address: 0.6 µs, and no array over the caller's tensor
                ctypes.memmove(dest.data_ptr(), base + start * size, numel * size)
            else:
                np.copyto(to_numpy(dest), run[start:start + numel].reshape(shape)[src])
        else:  # a conversion: torch's rounding, as every other read converts
            dest.copy_(flat[start:start + numel].view(shape)[src])
        nbytes += dest.numel() * dest.element_size()
    return nbytes
