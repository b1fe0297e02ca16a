"""Reading requested shards from a checkpoint source into their destinations.

Each requested ShardedTensor is planned against the stored shards of its key
(:mod:`lightning_distckpt.planning.load_plan`, resharding included) and turned into
:class:`~lightning_distckpt.storage.base.ShardRead` s whose destinations are views of the tensor
to return: the template's own ``data`` when that is a contiguous CPU tensor, else a CPU buffer
copied into ``data`` afterwards (one host-to-device copy for a GPU parameter).
"""

from __future__ import annotations

from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Set, Tuple

import torch

from ..core.errors import CheckpointingError
from ..core.mapping import ShardedObject, ShardedTensor
from ..planning.flat_plan import BoxRead, FlatReadPlan, StridedView
from ..planning.load_plan import plan_tensor_read, whole_stored
from ..storage.base import ShardRead, ShardReader
from ..storage.safe_pickle import loads
from .checkpoint import CheckpointSource
from .exchange_guard import allocate


class ReadTarget(NamedTuple):
    """Read the shard ``request`` asks for into ``dest``: a CPU tensor in the shard's global-axes
    shape (1-D, the flat range, for flattened requests)."""

    request: ShardedTensor
    dest: torch.Tensor


class ReadOutcome(NamedTuple):
    """A batch of reads: bytes, seconds, and the error that stopped it (None when it succeeded)."""

    nbytes: int
    seconds: float
    error: Optional[BaseException]


class _Copy(NamedTuple):
    """A strided copy done after the reads (from a span buffer into the destination)."""

    src: torch.Tensor
    dst: torch.Tensor


def read_shape(st: ShardedTensor) -> Tuple[int, ...]:
    """The shape a request is read in: its shard in global axes, or its flat range's length."""
    if st.flattened_range is None:
        return tuple(st.shard_shape)
    return (st.flattened_range.stop - st.flattened_range.start,)


def destination(st: ShardedTensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(tensor to return, CPU view in global-axes shape to read into). Reads land directly in the
    template's ``data`` when it is a contiguous CPU tensor; otherwise in a fresh CPU buffer."""
    data = st.data
    if data is not None and type(data) is torch.Tensor and not data.requires_grad and data.device.type == "cpu" \
            and data.is_contiguous():  # a plain CPU tensor: itself, no alias per key (thousands of small tensors)
        shape = read_shape(st)
        return data, data if data.shape == shape else data.view(shape)
    data = data.detach() if data is not None else None  # parameters (keep_vars) are written in place
    if data is not None and data.device.type == "cpu" and data.is_contiguous():
        return st.data, data.view(read_shape(st))
    buf = allocate(read_shape(st), st.dtype, torch.device("cpu"), False, st.key)  # names the key if it fails
    return buf, buf


def read_targets(source: CheckpointSource, targets: Sequence[ReadTarget], reader: ShardReader) -> int:
    """Read every target (concurrently, through ``reader``); returns bytes read."""
    reads: List[ShardRead] = []
    copies: List[_Copy] = []
    entries, stored_key = source.index.tensors, source.index.stored_key
    wholes: Dict[Tuple[int, ...], Tuple[slice, ...]] = {}  # shard shape -> the src selecting all of it
    for request, dest in targets:
        entry = entries[request.key]
        key = stored_key(request.key)  # an alias is read from its target's arrays (format 8)
        whole = whole_stored(request, entry)
        if whole is not None:  # a stored shard loaded as saved (plan_tensor_read's whole plan, not built)
            shape = tuple(request.shard_shape)
            src = wholes.get(shape)
            if src is None:
                src = wholes[shape] = tuple(slice(0, n) for n in shape)
            reads.append(ShardRead(key, whole[0], whole[1], src, dest))
            continue
        plan = plan_tensor_read(request, entry, source.path)
        if plan.zero_fill:
            dest.zero_()
        if isinstance(plan, FlatReadPlan):
            _flat_reads(key, plan, dest.reshape(-1), reads, copies)
        elif plan.whole:  # into dest itself (indexing it with whole slices costs a view per key)
            item = plan.items[0]
            reads.append(ShardRead(key, item.writer, item.index, item.src, dest))
        else:
            reads.extend(ShardRead(key, it.writer, it.index, it.src, dest[it.dst]) for it in plan.items)
    nbytes = reader.read_into(reads)
    for src, dst in copies:
        dst.copy_(src)
    return nbytes


def read_tensors(source: CheckpointSource, tensors: Sequence[ShardedTensor], skip: Set[str],
                 reader: Optional[ShardReader] = None) -> Tuple[List[Optional[torch.Tensor]], int]:
    """Read every requested tensor whose key is not in ``skip``; returns (the loaded tensor of each
    request, by position, None where skipped; bytes read). Pass ``reader`` to reuse one reader
    (its opened stores and arrays) over many calls."""
    out: List[Optional[torch.Tensor]] = [None] * len(tensors)
    targets: List[ReadTarget] = []
    for i, st in enumerate(tensors):
        if st.key in skip:
            continue
        out[i], view = destination(st)
        targets.append(ReadTarget(st, view))
    nbytes = read_targets(source, targets, reader or source.reader())
    for i, st in enumerate(tensors):
        res = out[i]
        if res is None:
            continue
        if st.data is not None and res is not st.data:
            st.data.detach().copy_(res.view(st.data.shape))  # e.g. a GPU parameter: one host-to-device copy
            out[i] = st.data
        elif st.data is None:
            out[i] = res.view(st.local_shape) if st.flattened_range is None else res
    return out, nbytes


def _strided(buf: torch.Tensor, v: StridedView) -> torch.Tensor:
    return buf.as_strided(v.shape, v.strides, buf.storage_offset() + v.offset)


def _flat_reads(key: str, plan: FlatReadPlan, dest: torch.Tensor, reads: List[ShardRead], copies: List[_Copy]) -> None:
    """Turn a flat plan into reads (into ``dest``, the request in row-major order, or into span
    buffers) and the strided copies from span buffers into ``dest`` done after the reads."""
    for item in plan.items:
        if isinstance(item, BoxRead):
            reads.append(ShardRead(key, item.writer, item.index, item.src, _strided(dest, item.dst)))
        elif item.direct:
            dst = item.copies[0][1]
            start = int(item.starts[0])
            reads.append(ShardRead(key, item.writer, item.index, (slice(start, start + item.length),),
                                   dest[dst.offset:dst.offset + item.length]))
        else:
            buf = torch.empty(item.read_numel, dtype=dest.dtype)
            for j, start in enumerate(item.starts.tolist()):
                reads.append(ShardRead(key, item.writer, item.index, (slice(start, start + item.length),),
                                       buf[j * item.length:(j + 1) * item.length]))
            copies.extend(_Copy(_strided(buf, src), _strided(dest, dst)) for src, dst in item.copies)


def read_objects(source: CheckpointSource, objects: Sequence[ShardedObject], skip: Set[str],
                 extra_safe_globals: Sequence[Any] = ()) -> List[Optional[Any]]:
    """The loaded value of each requested object, by position (None where its key is in ``skip``)."""
    if not objects:
        return []
    reader = source.reader()
    out: List[Optional[Any]] = [None] * len(objects)
    for i, so in enumerate(objects):
        if so.key in skip:
            continue
        stored = next((s for s in source.index.objects[so.key].shards if tuple(s.offset) == so.global_offset), None)
        if stored is None:
            raise CheckpointingError(f"checkpoint {source.path}: object {so.key!r} has no element at "
                                     f"{so.global_offset}")
        blob = reader.read_object(stored.writer, so.key, stored.index)
        out[i] = loads(blob, f"checkpoint {source.path}: object {so.key!r}", extra_safe_globals)
    return out
