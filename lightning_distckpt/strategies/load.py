"""The load path (every rank reads what it needs): check the checkpoint, match keys, plan the
reads of each requested shard from the stored shards, read into the template's tensors, put the
common state back."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import torch

from ..comm import Comm
from ..core.errors import CheckpointingError
from ..core.mapping import LocalNonpersistentObject, ShardedObject, ShardedTensor
from ..core.state_dict import apply_factories, collect, merge, merge_factories, replace_leaves, split_common
from ..core.strict import StrictHandling, check_keys
from ..planning.flat_plan import BoxRead, FlatReadPlan, StridedView
from ..planning.load_plan import plan_tensor_read
from ..planning.metadata import CheckpointIndex
from ..storage.layout import COMMON_FILE, read_metadata
from ..storage.safe_pickle import loads, read_file
from ..storage.base import ShardRead
from ..storage.tensorstore_io import StorageOptions, TensorStoreIO
from .stats import log_throughput

logger = logging.getLogger("lightning_distckpt")


@dataclass
class OpenedCheckpoint:
    """A committed checkpoint's parsed metadata."""

    path: str
    meta: Dict[str, Any]
    index: CheckpointIndex
    options: StorageOptions

    @classmethod
    def open(cls, checkpoint_dir: str) -> "OpenedCheckpoint":
        path = os.path.abspath(os.fspath(checkpoint_dir))
        meta = read_metadata(path)
        return cls(path, meta, CheckpointIndex.from_json(meta, f"checkpoint {path}"),
                   StorageOptions.from_json(meta.get("storage", {})))

    def reader(self) -> TensorStoreIO:
        """A reader of this checkpoint's stored shards (packed ones included) and objects."""
        return TensorStoreIO(self.path, self.options, self.index)

    def load_common(self, extra_safe_globals: Sequence[Any] = ()) -> Any:
        common_path = os.path.join(self.path, COMMON_FILE)
        if not os.path.isfile(common_path):
            raise CheckpointingError(f"checkpoint {self.path}: {COMMON_FILE} is missing")
        return loads(read_file(common_path), f"checkpoint {self.path}: {COMMON_FILE}", extra_safe_globals)


@dataclass
class LoadRequest:
    """The template split into what is read and what is only put back."""

    tree: Any  # sharded part of the expanded template (factory expansions kept)
    tensors: List[ShardedTensor]
    objects: List[ShardedObject]


def make_request(sharded_state_dict: Dict[str, Any]) -> LoadRequest:
    sharded, _ = split_common(apply_factories(sharded_state_dict))
    found = collect(sharded)
    return LoadRequest(sharded, found["tensors"], found["objects"])


def match_keys(
    ckpt: OpenedCheckpoint, req: LoadRequest, comm: Comm, strict: StrictHandling
) -> Tuple[Set[str], Set[str]]:
    """Collective: missing keys (over all ranks) and unexpected keys (asked for by no rank);
    raises on every rank alike when ``strict`` says so."""
    asked = {t.key for t in req.tensors if t.key} | {o.key for o in req.objects}
    mine_missing = {t.key for t in req.tensors if t.key not in ckpt.index.tensors}
    mine_missing |= {o.key for o in req.objects if o.key not in ckpt.index.objects}
    gathered = comm.all_gather_object((sorted(asked) if strict.needs_unexpected else [], sorted(mine_missing)))
    missing = {k for _, m in gathered for k in m}
    unexpected: Set[str] = set()
    if strict.needs_unexpected:
        asked_all = {k for a, _ in gathered for k in a}
        unexpected = (set(ckpt.index.tensors) | set(ckpt.index.objects)) - asked_all
    return check_keys(strict, ckpt.path, missing, unexpected)


def destination(st: ShardedTensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(tensor to return, CPU view in global-axes shape to read into). Reads land directly in the
    template's ``data`` when it is a contiguous CPU tensor; otherwise in a fresh CPU buffer."""
    shape = st.shard_shape if st.flattened_range is None else (st.flattened_range.stop - st.flattened_range.start,)
    data = st.data.detach() if st.data is not None else None  # parameters (keep_vars) are written in place
    if data is not None and data.device.type == "cpu" and data.is_contiguous():
        return st.data, data.view(shape)
    buf = torch.empty(shape, dtype=st.dtype)
    return buf, buf


def read_tensors(ckpt: OpenedCheckpoint, tensors: Sequence[ShardedTensor], skip: Set[str],
                 io: Optional[TensorStoreIO] = None) -> Tuple[Dict[int, torch.Tensor], int]:
    """Read every requested tensor (not in ``skip``); returns ({id(st): tensor}, bytes read).
    Pass ``io`` to reuse one reader (its opened stores and arrays) over many calls."""
    io = io or ckpt.reader()
    out: Dict[int, torch.Tensor] = {}
    reads = []
    copies: List[Tuple[torch.Tensor, torch.Tensor]] = []  # (span buffer view, destination view), after reads
    for st in tensors:
        if st.key in skip:
            continue
        plan = plan_tensor_read(st, ckpt.index.tensors[st.key], ckpt.path)
        result, view = destination(st)
        if plan.zero_fill:
            view.zero_()
        if isinstance(plan, FlatReadPlan):
            _flat_reads(st.key, plan, view.reshape(-1), reads, copies)
        else:
            for item in plan.items:
                reads.append(ShardRead(st.key, item.writer, item.index, item.src, view[item.dst]))
        out[id(st)] = result
    nbytes = io.read_into(reads)
    for src, dst in copies:
        dst.copy_(src)
    for st in tensors:
        res = out.get(id(st))
        if res is None:
            continue
        if st.data is not None and res is not st.data:
            st.data.detach().copy_(res.view(st.data.shape))  # e.g. a GPU parameter: one host-to-device copy
            out[id(st)] = st.data
        elif st.data is None:
            out[id(st)] = res.view(st.local_shape) if st.flattened_range is None else res
    return out, nbytes


def _strided(buf: torch.Tensor, v: StridedView) -> torch.Tensor:
    return buf.as_strided(v.shape, v.strides, buf.storage_offset() + v.offset)


def _flat_reads(key: str, plan: FlatReadPlan, dest: torch.Tensor, reads: List[Any],
                copies: List[Tuple[torch.Tensor, torch.Tensor]]) -> None:
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
            copies.extend((_strided(buf, src), _strided(dest, dst)) for src, dst in item.copies)


def read_objects(ckpt: OpenedCheckpoint, objects: Sequence[ShardedObject], skip: Set[str],
                 extra_safe_globals: Sequence[Any] = ()) -> Dict[int, Any]:
    io = ckpt.reader()
    out: Dict[int, Any] = {}
    for so in objects:
        if so.key in skip:
            continue
        entry = ckpt.index.objects[so.key]
        stored = next((s for s in entry.shards if tuple(s.offset) == so.global_offset), None)
        if stored is None:
            raise CheckpointingError(f"checkpoint {ckpt.path}: object {so.key!r} has no element at {so.global_offset}")
        blob = io.read_object(stored.writer, so.key, stored.index)
        out[id(so)] = loads(blob, f"checkpoint {ckpt.path}: object {so.key!r}", extra_safe_globals)
    return out


def assemble(req: LoadRequest, common: Any, tensors: Dict[int, Any], objects: Dict[int, Any]) -> Dict[str, Any]:
    """Put loaded values in place of the template's entries, fold factories, merge the common state."""

    def fill(leaf: Any) -> Any:
        if isinstance(leaf, ShardedTensor):
            return tensors.get(id(leaf), leaf.data)
        if isinstance(leaf, ShardedObject):
            return objects.get(id(leaf), leaf.data)
        if isinstance(leaf, LocalNonpersistentObject):
            return leaf.unwrap()
        return leaf

    loaded = merge_factories(replace_leaves(req.tree, fill))
    return merge(common if isinstance(common, dict) else {}, loaded)


def load_every_rank_reads(
    sharded_state_dict: Dict[str, Any],
    checkpoint_dir: str,
    comm: Comm,
    strict: StrictHandling,
    extra_safe_globals: Sequence[Any] = (),
) -> Tuple[Dict[str, Any], Set[str], Set[str]]:
    """Collective load where each rank reads exactly the pieces its shards need."""
    t0 = time.perf_counter()
    ckpt = OpenedCheckpoint.open(checkpoint_dir)
    req = make_request(sharded_state_dict)
    missing, unexpected = match_keys(ckpt, req, comm, strict)
    error: Optional[str] = None
    nbytes, io_s = 0, 0.0
    state: Dict[str, Any] = {}
    try:
        t_io = time.perf_counter()
        tensors, nbytes = read_tensors(ckpt, req.tensors, missing)
        objects = read_objects(ckpt, req.objects, missing, extra_safe_globals)
        io_s = time.perf_counter() - t_io
        state = assemble(req, ckpt.load_common(extra_safe_globals), tensors, objects)
    except CheckpointingError as e:
        error = str(e)
    gathered = comm.all_gather_object((error, (nbytes, io_s)))
    failures = [(rk, err) for rk, (err, _) in enumerate(gathered) if err]
    if failures:
        raise CheckpointingError(
            f"load from {ckpt.path} failed: " + "; ".join(f"rank {rk}: {err}" for rk, err in failures)
        )
    log_throughput("load", ckpt.path, comm.rank, [g[1] for g in gathered], time.perf_counter() - t0)
    return state, missing, unexpected
