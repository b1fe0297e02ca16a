"""What moves: each rank's needs (boxes of source tensors), and rank 0's manifest of broadcasts.

Pure functions of the sharded state dicts and rank 0's state dict; no collectives. The manifest is
decided on rank 0 and broadcast before any data moves, with the error when there is one, so every
rank fails the same way at the same point.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import AbstractSet, Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch

from ..core.errors import ArgumentTypeError, CheckpointingError, FormatError, MissingKeysError, ShardingError
from ..core.mapping import ShardedTensor
from ..core.shown import quoted
from ..planning.load_plan import dtype_kind

Box = Tuple[Tuple[int, ...], Tuple[int, ...]]  # (offset, shape) in the global tensor's axes
ALIGN = 64  # byte alignment of tensors inside a bucket (any dtype can be viewed there)


@dataclass(frozen=True)
class Need:
    """One entry of one rank's sharded state dict: the box of source tensor ``key`` it holds.

    ``offset`` / ``shape`` are in global axes (prepended axes included, size 1 there);
    ``local_shape`` is the shape the shard takes; ``flat`` the ``[start, stop)`` of the flattened
    local shard for flattened entries.
    """

    rank: int
    name: str
    key: str
    global_shape: Tuple[int, ...]
    offset: Tuple[int, ...]
    shape: Tuple[int, ...]
    local_shape: Tuple[int, ...]
    flat: Optional[Tuple[int, int]]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class SendItem:
    """A box of one source tensor inside a broadcast: bytes ``[start, start + nbytes)`` of the buffer.
    ``global_shape`` and ``dtype``: the source tensor as rank 0 checked it (its send checks it again)."""

    key: str
    dtype: torch.dtype
    offset: Tuple[int, ...]
    shape: Tuple[int, ...]
    start: int
    nbytes: int
    global_shape: Tuple[int, ...] = ()


@dataclass(frozen=True)
class SendOp:
    """One broadcast from rank 0: a single large box, or a bucket of small ones."""

    items: Tuple[SendItem, ...]
    nbytes: int


@dataclass(frozen=True)
class Manifest:
    """Rank 0's decision, broadcast to every rank before data moves.

    ``error`` is ``(error class name, message)`` when the load cannot go on; ``missing`` the keys
    skipped because rank 0 lacks them (only when allowed); ``unexpected`` rank 0's keys no rank
    asked for; ``sent_bytes`` / ``whole_bytes`` what the broadcasts carry and what broadcasting the
    whole tensors would have.
    """

    source: str
    ops: Tuple[SendOp, ...] = ()
    missing: Tuple[str, ...] = ()
    unexpected: Tuple[str, ...] = ()
    error: Optional[Tuple[str, str]] = None
    sent_bytes: int = 0
    whole_bytes: int = 0


def collect_needs(meta_sharded_state_dict: Mapping[str, Any], rank: int) -> List[Need]:
    """This rank's needs. Entries are :class:`ShardedTensor` s (their ``data`` may be on the meta
    device) or plain tensors (the whole tensor under its own name, on every rank)."""
    if not isinstance(meta_sharded_state_dict, Mapping):
        raise ArgumentTypeError(
            f"meta_sharded_state_dict must be a mapping of names to ShardedTensors, got "
            f"{type(meta_sharded_state_dict).__name__}")
    needs = []
    for name, entry in meta_sharded_state_dict.items():
        if isinstance(entry, ShardedTensor):
            fr = entry.flattened_range
            needs.append(Need(rank, name, entry.key, entry.global_shape, entry.global_offset, entry.shard_shape,
                              entry.local_shape, None if fr is None else (fr.start, fr.stop), entry.dtype))
        elif isinstance(entry, torch.Tensor):
            shape = tuple(entry.shape)
            needs.append(Need(rank, name, name, shape, (0,) * len(shape), shape, shape, None, entry.dtype))
        else:
            raise ArgumentTypeError(
                f"meta_sharded_state_dict[{name!r}] is a {type(entry).__name__}; entries must be ShardedTensors "
                f"(or plain tensors, loaded whole)")
    return needs


def describe_source(state_dict: Mapping[str, Any], key: Optional[str] = None) -> str:
    """The file a key comes from (see :class:`~.files.CheckpointStateDict`), else a generic name."""
    files = getattr(state_dict, "files", {})
    if key is not None and key in files:
        return files[key]
    return getattr(state_dict, "source", "the state dict given on rank 0")


def build_manifest(state_dict: Mapping[str, Any], needs: Sequence[Need], *, bucket_bytes: int,
                   missing_ok: Union[bool, AbstractSet[str]] = False, unexpected_ok: bool = True) -> Manifest:
    """Rank 0: check every need against the source tensors and plan the broadcasts.

    Each source tensor is sent at most once, as the bounding box of the boxes that ranks other
    than 0 hold (rank 0 cuts its own shards from the source); tensors smaller than
    ``bucket_bytes`` share broadcasts of up to ``bucket_bytes``. Any problem is returned in
    ``error`` instead of raised, for the caller to broadcast. Keys asked for and missing are an
    error unless ``missing_ok`` (True, or a set holding them: tied weights saved once); keys of ``state_dict``
    nobody asked for unless ``unexpected_ok``.
    """
    source = describe_source(state_dict)
    try:
        by_key: Dict[str, List[Need]] = {}
        for n in needs:
            by_key.setdefault(n.key, []).append(n)
        missing = [k for k in by_key if k not in state_dict]
        refused = [] if missing_ok is True else [k for k in missing if missing_ok is False or k not in missing_ok]
        if refused:
            raise MissingKeysError(
                f"{source}: {len(refused)} key(s) asked for are not in the state dict: {_names(refused, by_key)}")
        # Source order (file order for a loaded file): the memory map is read front to back.
        unexpected = tuple(k for k in state_dict if k not in by_key)
        if unexpected and not unexpected_ok:
            raise MissingKeysError(f"{source}: {len(unexpected)} key(s) of the state dict are asked for by no entry: "
                                   f"{', '.join(map(quoted, unexpected[:10]))}"
                                   + (" ..." if len(unexpected) > 10 else ""))
        ordered = [k for k in state_dict if k in by_key]
        items: List[Tuple[str, torch.dtype, Box, int, Tuple[int, ...]]] = []
        whole = 0
        for key in ordered:
            tensor = state_dict[key]
            check_source_tensor(state_dict, key, tensor, by_key[key])
            box = _bounding_box([n for n in by_key[key] if n.rank != 0 and n.numel > 0])
            if box is not None:
                items.append((key, tensor.dtype, box, math.prod(box[1]) * tensor.element_size(), tuple(tensor.shape)))
                whole += tensor.numel() * tensor.element_size()
        ops = _pack(items, bucket_bytes)
        return Manifest(source, ops, tuple(missing), unexpected, None, sum(o.nbytes for o in ops), whole)
    except CheckpointingError as e:
        return Manifest(source, error=(type(e).__name__, str(e)))


def _names(keys: Sequence[str], by_key: Mapping[str, List[Need]], limit: int = 10) -> str:
    # a file's keys are anyone's: quoted (escaped, a long one cut short)
    shown = ", ".join(f"{quoted(k)} (for {quoted(by_key[k][0].name)})" if by_key[k][0].name != k else quoted(k)
                      for k in keys[:limit])
    return shown + (f" and {len(keys) - limit} more" if len(keys) > limit else "")


def check_source_tensor(state_dict: Mapping[str, Any], key: str, tensor: Any, needs: Sequence[Need]) -> None:
    """Rank 0's tensor ``key`` can fill ``needs``: a dense tensor with data, of their global shape and of a
    dtype of the same kind (ShardingError / FormatError naming the file and the key)."""
    where = f"{describe_source(state_dict, key)}: {quoted(key)}"
    if not isinstance(tensor, torch.Tensor):
        raise FormatError(f"{where} is a {type(tensor).__name__}, not a tensor")
    if tensor.device.type == "meta":
        raise FormatError(f"{where} is on the meta device: rank 0's state dict must hold the data")
    if tensor.is_quantized:
        raise FormatError(f"{where} is a quantized tensor ({str(tensor.dtype).replace('torch.', '')}); dequantize it "
                          "first: quantized tensors are not sharded here")
    for n in needs:
        if tuple(tensor.shape) != n.global_shape:
            raise ShardingError(
                f"{where} has shape {tuple(tensor.shape)} but rank {n.rank}'s entry {n.name!r} describes a global "
                f"shape {n.global_shape} (a shape mismatch is not padded or truncated here)")
        if dtype_kind(n.dtype) != dtype_kind(tensor.dtype):  # complex a kind of its own: never its real parts
            raise ShardingError(
                f"{where} is stored as {str(tensor.dtype).replace('torch.', '')} but rank {n.rank}'s entry {n.name!r} "
                f"is {str(n.dtype).replace('torch.', '')}; floating dtypes convert to floating ones, integer "
                f"dtypes to integer ones and complex dtypes to complex ones only")


def _bounding_box(needs: Sequence[Need]) -> Optional[Box]:
    if not needs:
        return None
    lo = [min(n.offset[a] for n in needs) for a in range(len(needs[0].offset))]
    hi = [max(n.offset[a] + n.shape[a] for n in needs) for a in range(len(lo))]
    return tuple(lo), tuple(h - l for l, h in zip(lo, hi))


def _pack(items: Sequence[Tuple[str, torch.dtype, Box, int, Tuple[int, ...]]], bucket_bytes: int) -> Tuple[SendOp, ...]:
    """Large boxes one broadcast each; small ones together, in order, up to ``bucket_bytes``."""
    ops: List[SendOp] = []
    bucket: List[SendItem] = []
    end = 0
    for key, dtype, (off, shape), nbytes, whole in items:
        if nbytes >= bucket_bytes:
            ops.append(SendOp((SendItem(key, dtype, off, shape, 0, nbytes, whole),), nbytes))
            continue
        start = -(-end // ALIGN) * ALIGN
        if bucket and start + nbytes > bucket_bytes:
            ops.append(SendOp(tuple(bucket), end))
            bucket, start = [], 0
        bucket.append(SendItem(key, dtype, off, shape, start, nbytes, whole))
        end = start + nbytes
    if bucket:
        ops.append(SendOp(tuple(bucket), end))
    return tuple(ops)


def cut(need: Need, box: torch.Tensor, origin: Sequence[int], device: torch.device) -> torch.Tensor:
    """A new contiguous tensor on ``device`` with ``need``'s shard, taken from ``box`` (a box of
    the source tensor at ``origin``), converted to ``need.dtype``."""
    rel = tuple(slice(o - g, o - g + s) for o, g, s in zip(need.offset, origin, need.shape))
    piece = box[rel].reshape(need.local_shape)
    if need.flat is not None:
        piece = piece.reshape(-1)[need.flat[0]:need.flat[1]]
    return torch.empty(piece.shape, dtype=need.dtype, device=device).copy_(piece)
