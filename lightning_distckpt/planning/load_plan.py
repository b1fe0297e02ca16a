"""What to read: for each requested shard, the pieces of stored shards that overlap it.

Pure functions of the requested ShardedTensor and the checkpoint index, so any rank can read
any slice of any tensor (resharding) and the plan is testable without files.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from ..core.errors import ArgumentError, ArgumentTypeError, CheckpointingError, ShardingError
from ..core.mapping import ShardedTensor, ShardedTensorFactory
from ..core.state_dict import map_leaves
from .boxes import intersect
from .coverage import check_disjoint
from .dtypes import dtype_kind
from .flat_plan import FlatReadPlan, is_flattened, plan_flat_read
from .metadata import TensorEntry


@dataclass(frozen=True)
class ReadItem:
    """Copy ``src`` of stored shard ``(writer, index)`` into ``dst`` of the requested shard.

    Both are tuples of slices in the shard's own coordinates (global axes, prepended included).
    """

    writer: int
    index: int
    src: Tuple[slice, ...]
    dst: Tuple[slice, ...]

    @property
    def numel(self) -> int:
        return math.prod(s.stop - s.start for s in self.src)


@dataclass(frozen=True)
class TensorReadPlan:
    key: str
    items: Tuple[ReadItem, ...]
    zero_fill: bool  # part of the requested shard lies outside the saved tensor
    whole: bool = False  # one item, the whole of one stored shard into the whole request (no slicing needed)


def _rel(off: Sequence[int], shape: Sequence[int], origin: Sequence[int]) -> Tuple[slice, ...]:
    return tuple(slice(o - g, o - g + s) for o, s, g in zip(off, shape, origin))


SAME_KIND = "same_kind"
ANY = "any"
CAST_RULES = (SAME_KIND, ANY)
"""``load(..., cast=)``: ``"same_kind"`` (the default) converts between floating dtypes, between
integer dtypes and between complex dtypes only; ``"any"`` converts across kinds too (integer <->
floating, anything <-> bool, real -> complex), as Megatron-Core and torch DCP do, each value as
``Tensor.to(dtype)`` converts it; complex -> real is refused under either (it would drop the
imaginary parts)."""


def parse_cast(cast: Any, what: str = "cast") -> str:
    """``cast`` checked: one of :data:`CAST_RULES`, else ArgumentTypeError / ArgumentError naming ``what``."""
    if not isinstance(cast, str):
        raise ArgumentTypeError(f"{what} must be one of {list(CAST_RULES)}, got {type(cast).__name__}")
    if cast not in CAST_RULES:
        raise ArgumentError(f"{what} must be one of {list(CAST_RULES)}, got {cast!r}")
    return cast


def check_dtype_conversion(request: ShardedTensor, entry: TensorEntry, checkpoint_dir: str,
                           cast: str = SAME_KIND) -> None:
    """The dtype rule of a load, checked for each requested tensor when the load begins.

    Loading converts between floating dtypes (e.g. fp32 master weights into a bf16 model, float8
    included), between integer dtypes and between complex dtypes, as ``Tensor.copy_`` would. A
    conversion across kinds (floating <-> integer, anything <-> bool, real -> complex) is almost
    always a template built wrongly and would silently truncate (pytorch/pytorch#187138 asks DCP to
    stop doing it), so it is refused unless the caller asks for it with ``cast="any"``. Complex into
    a real dtype is refused even then: ``Tensor.to`` keeps only the real parts."""
    stored = entry.torch_dtype
    wanted = request.data.dtype if request.data is not None else request.dtype
    if wanted is None or wanted == stored:
        return
    if stored.is_complex and not wanted.is_complex:
        raise ShardingError(
            f"checkpoint {checkpoint_dir}: {request.key!r} is stored as {entry.dtype} but the template asks for "
            f"{str(wanted).replace('torch.', '')}; a complex tensor is never loaded into a real dtype, not even with "
            f"cast='any' (its imaginary parts would be dropped): load it into a tensor of dtype {entry.dtype} and "
            f"take .real / .imag / .abs() yourself")
    if cast == ANY or dtype_kind(wanted) == dtype_kind(stored):
        return
    raise ShardingError(
        f"checkpoint {checkpoint_dir}: {request.key!r} is stored as {entry.dtype} but the template asks for "
        f"{str(wanted).replace('torch.', '')}; loading converts between floating dtypes, between integer dtypes "
        f"and between complex dtypes only (load into a tensor of dtype {entry.dtype} and convert it yourself, or, "
        f"if this conversion is intended, pass cast='any' to load / set `cast: any` in the checkpoint config)"
    )


SHAPE_MISMATCH_ADVICE = (
    "to load anyway (a larger tensor zero-padded, a smaller one truncated): allow_shape_mismatch=True on the "
    "ShardedTensor, or, under the Lightning strategies and DistCheckpointIO, the checkpoint config's "
    "allow_shape_mismatch: true (DistCheckpointStrategy(checkpoint={'allow_shape_mismatch': True}), or "
    "allow_shape_mismatch: true in the YAML checkpoint: section)")
_SHOWN_MISMATCHES = 100


def check_global_shapes(requests: Sequence[ShardedTensor], entries: Mapping[str, TensorEntry],
                        checkpoint_dir: str) -> None:
    """Every requested tensor's global shape against the stored one: one ShardingError listing
    every key whose shape differs (each once) and how to allow it, or none. Keys that allow a
    mismatch are skipped unless their number of axes differs (that cannot be padded); keys
    missing from ``entries`` are the key matching's business."""
    found: Dict[str, str] = {}
    allowable = True
    for st in requests:
        entry = entries.get(st.key)
        if entry is None or st.key in found:
            continue
        saved, asked = tuple(entry.global_shape), tuple(st.global_shape)
        if len(saved) != len(asked):
            found[st.key] = (f"{st.key!r} has global shape {saved} in the checkpoint, {asked} in the template "
                             f"({len(saved)} axes, not {len(asked)})")
            allowable = False
        elif saved != asked and not st.allow_shape_mismatch:
            found[st.key] = f"{st.key!r} has global shape {saved} in the checkpoint, {asked} in the template"
    if not found:
        return
    shown = list(found.values())[:_SHOWN_MISMATCHES]
    more = f"; and {len(found) - len(shown)} more" if len(found) > len(shown) else ""
    raise ShardingError(
        f"checkpoint {checkpoint_dir}: {len(found)} tensor(s) differ in shape: {'; '.join(shown)}{more}. "
        + (SHAPE_MISMATCH_ADVICE[0].upper() + SHAPE_MISMATCH_ADVICE[1:] if allowable else
           "A different number of axes cannot be padded or truncated: build the model as the checkpoint was saved"))


def allowing_shape_mismatch(template: Any) -> Any:
    """``template`` (a load's sharded state dict) with ``allow_shape_mismatch=True`` on every
    ShardedTensor, those its factories build included (containers copied, tensors shared): how the
    Lightning plugin applies its config's ``allow_shape_mismatch``."""

    def allow(leaf: Any) -> Any:
        if isinstance(leaf, ShardedTensor):
            return dataclasses.replace(leaf, allow_shape_mismatch=True)
        if isinstance(leaf, ShardedTensorFactory):
            build = leaf.build_fn
            return dataclasses.replace(leaf, build_fn=lambda *args: allowing_shape_mismatch(build(*args)))
        return leaf

    return map_leaves(allow, template)


def whole_stored(request: ShardedTensor, entry: TensorEntry) -> Optional[Tuple[int, int]]:
    """``(writer, index)`` of the stored shard that is exactly ``request``'s shard, where
    :func:`plan_tensor_read` plans its one whole read (the global shape as saved, nothing
    flattened); else None (plan it). Many small tensors loaded as saved: no plan objects per key."""
    if request.flattened_range is not None or tuple(entry.global_shape) != tuple(request.global_shape):
        return None
    off, shape = request.global_offset, request.shard_shape
    even = entry.even
    if even is not None:
        chunk = even.chunk_at(entry.global_shape, off, shape) if shape else None
        return None if chunk is None else (chunk, chunk)  # chunk i is stored shard i, written by rank i
    shards = entry.shards
    if len(shards) != 1:
        return None
    s = shards[0]
    if s.flat or tuple(s.offset) != tuple(off) or tuple(s.shape) != tuple(shape):
        return None
    return s.writer, s.index


def plan_tensor_read(request: ShardedTensor, entry: TensorEntry,
                     checkpoint_dir: str) -> Union["TensorReadPlan", FlatReadPlan]:
    """Plan reading ``request``'s shard from the stored shards of ``entry``.

    With ``allow_shape_mismatch`` the saved global shape may differ: the requested box is clipped
    to the saved tensor and the rest zero-filled (a larger target is padded, a smaller one truncated).
    When the request or a stored shard is flattened, returns :func:`plan_flat_read`'s plan.
    Dtypes are not looked at here: the load checked them when it began
    (:func:`check_dtype_conversion`), and the readers convert to the destination's dtype.
    """
    key = request.key
    saved_shape = tuple(entry.global_shape)
    if len(saved_shape) != len(request.global_shape):
        raise ShardingError(
            f"checkpoint {checkpoint_dir}: {key!r} has {len(saved_shape)} axes {saved_shape} in the checkpoint but "
            f"{len(request.global_shape)} axes {request.global_shape} were asked for"
        )
    if saved_shape != tuple(request.global_shape) and not request.allow_shape_mismatch:
        raise ShardingError(
            f"checkpoint {checkpoint_dir}: {key!r} has global shape {saved_shape} in the checkpoint but "
            f"{request.global_shape} was asked for ({SHAPE_MISMATCH_ADVICE})"
        )
    if request.flattened_range is not None or is_flattened(entry):
        return plan_flat_read(request, entry, checkpoint_dir)
    off, shape = request.global_offset, request.shard_shape
    stored = entry.shards_in_rows(off[0], off[0] + shape[0]) if shape else entry.shards
    if len(stored) == 1 and tuple(stored[0].offset) == tuple(off) and tuple(stored[0].shape) == tuple(shape):
        # the request is a stored shard (loaded as saved): one item, no box arithmetic; stored shards lie
        # inside the saved tensor (checked when the index was read), so nothing is zero-filled
        whole = tuple(slice(0, n) for n in shape)
        return TensorReadPlan(key, (ReadItem(stored[0].writer, stored[0].index, whole, whole),), False, True)
    items: List[ReadItem] = []
    used: List[Any] = []
    covered = 0
    for s in stored:
        inter = intersect(off, shape, s.offset, s.shape)
        if inter is None:
            continue
        used.append(s)
        ioff, ishape = inter
        items.append(ReadItem(s.writer, s.index, _rel(ioff, ishape, s.offset), _rel(ioff, ishape, off)))
        covered += math.prod(ishape)
    clipped = intersect(off, shape, (0,) * len(saved_shape), saved_shape)
    wanted = math.prod(clipped[1]) if clipped else 0
    if covered != wanted:
        raise CheckpointingError(
            f"checkpoint {checkpoint_dir}: {key!r}: stored shards cover {covered} of the {wanted} elements asked for "
            f"at offset {off} shape {shape}; the checkpoint is incomplete or corrupt"
        )
    check_disjoint(used, key, checkpoint_dir)  # the count above holds when an overlap hides a gap
    return TensorReadPlan(key, tuple(items), zero_fill=wanted < math.prod(shape))
