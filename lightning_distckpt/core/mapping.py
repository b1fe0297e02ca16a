"""The sharded state dict data model: pure dataclasses, checked at construction, no I/O.

A *sharded state dict* is a nested dict/list whose leaves are either:

* ``ShardedTensor`` - a local tensor and where it sits in a global tensor;
* ``ShardedObject`` - one element of a global array of Python objects;
* ``ShardedTensorFactory`` - a deferred transform expanded into the above on save and load;
* ``LocalNonpersistentObject`` - a local value that is not saved and is returned as is on load;
* anything else - "common" state, written once (by one rank).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Tuple, Union

import torch

from .errors import ShardingError
from .megatron_methods import MegatronFactoryMethods, MegatronObjectMethods, MegatronTensorMethods

ReplicaId = Union[int, Tuple[int, ...]]


def is_main_replica(replica_id: ReplicaId) -> bool:
    """All-zeros replica ids mark the main replica (the one written by default)."""
    if isinstance(replica_id, int):
        return replica_id == 0
    return all(r == 0 for r in replica_id)


def _check_replica_id(key: str, replica_id: ReplicaId) -> ReplicaId:
    if isinstance(replica_id, list):
        replica_id = tuple(replica_id)
    ok = (isinstance(replica_id, int) and replica_id >= 0) or (
        isinstance(replica_id, tuple) and all(isinstance(r, int) and r >= 0 for r in replica_id)
    )
    if not ok:
        raise ShardingError(f"{key!r}: replica_id must be a non-negative int or tuple of them, got {replica_id!r}")
    return replica_id


def _check_key(kind: str, key: Any) -> None:
    if not isinstance(key, str) or not key:
        raise ShardingError(f"{kind} key must be a non-empty string, got {key!r}")


def _require_tensor(key: str, data: object) -> None:
    """The constructors read ``data``'s shape and dtype: anything but a tensor is a ShardingError."""
    if not isinstance(data, torch.Tensor):
        raise ShardingError(f"{key!r}: data must be a torch.Tensor, got {type(data).__name__}")


@dataclass
class ShardedTensor(MegatronTensorMethods):
    """A local tensor and its place in a global tensor.

    Attributes:
        key: name of the global tensor in the checkpoint.
        data: the local tensor (``None`` for a metadata-only description). With
            ``flattened_range`` set, a 1-D slice of the flattened local shard.
        dtype: dtype of the data (taken from ``data`` when omitted).
        local_shape: shape of the local shard, without prepended axes (for flattened
            shards: the shape before flattening).
        global_shape: shape of the global tensor, prepended axes included.
        global_offset: offset of the local shard in the global tensor, prepended axes included.
        axis_fragmentations: number of fragments along each global axis (``None`` for
            uneven shardings built with :meth:`from_offsets`).
        replica_id: all zeros marks the main replica; other values mark copies of it.
        prepend_axis_num: number of leading global axes the local tensor lacks (size 1 locally).
        allow_shape_mismatch: on load, the saved global shape may differ from ``global_shape``:
            the part outside the saved tensor is zero-filled, the rest of the saved tensor ignored.
        flattened_range: ``slice(start, stop)`` into the flattened local shard, for optimizer
            states kept flat (distributed optimizer).
    """

    key: str
    data: Optional[torch.Tensor]
    dtype: Optional[torch.dtype]
    local_shape: Tuple[int, ...]
    global_shape: Tuple[int, ...]
    global_offset: Tuple[int, ...]
    axis_fragmentations: Optional[Tuple[int, ...]] = None
    replica_id: ReplicaId = 0
    prepend_axis_num: int = 0
    allow_shape_mismatch: bool = False
    flattened_range: Optional[slice] = None

    def __post_init__(self) -> None:
        _check_key("ShardedTensor", self.key)
        k = self.key
        self.local_shape = tuple(int(s) for s in self.local_shape)
        self.global_shape = tuple(int(s) for s in self.global_shape)
        self.global_offset = tuple(int(s) for s in self.global_offset)
        self.replica_id = _check_replica_id(k, self.replica_id)
        if self.data is not None and not isinstance(self.data, torch.Tensor):
            raise ShardingError(f"{k!r}: data must be a torch.Tensor or None, got {type(self.data).__name__}")
        if self.dtype is None:
            if self.data is None:
                raise ShardingError(f"{k!r}: dtype is required when data is None")
            self.dtype = self.data.dtype
        if self.data is not None and self.data.dtype != self.dtype:
            raise ShardingError(f"{k!r}: data dtype {self.data.dtype} disagrees with dtype {self.dtype}")
        if self.prepend_axis_num < 0:
            raise ShardingError(f"{k!r}: prepend_axis_num must be >= 0, got {self.prepend_axis_num}")
        ndim = self.prepend_axis_num + len(self.local_shape)
        if len(self.global_shape) != ndim or len(self.global_offset) != ndim:
            raise ShardingError(
                f"{k!r}: global_shape {self.global_shape} and global_offset {self.global_offset} must have "
                f"{ndim} axes (prepend_axis_num={self.prepend_axis_num} + local {self.local_shape})"
            )
        for ax, (off, loc, glob) in enumerate(zip(self.global_offset, self.shard_shape, self.global_shape)):
            if off < 0 or loc < 0 or off + loc > glob:
                raise ShardingError(
                    f"{k!r}: axis {ax}: shard [{off}, {off + loc}) lies outside the global size {glob} "
                    f"(global_offset={self.global_offset}, global_shape={self.global_shape})"
                )
        if self.axis_fragmentations is not None:
            self.axis_fragmentations = tuple(int(f) for f in self.axis_fragmentations)
            if len(self.axis_fragmentations) != ndim:
                raise ShardingError(f"{k!r}: axis_fragmentations {self.axis_fragmentations} must have {ndim} axes")
            for ax, (frag, loc, glob, off) in enumerate(
                zip(self.axis_fragmentations, self.shard_shape, self.global_shape, self.global_offset)
            ):
                if frag < 1 or frag * loc != glob or (loc and off % loc):
                    raise ShardingError(
                        f"{k!r}: axis {ax}: {frag} fragments of size {loc} do not tile global size {glob} "
                        f"at offset {off}"
                    )
        if self.flattened_range is not None:
            fr = self.flattened_range
            if not isinstance(fr, slice) or fr.step not in (None, 1) or fr.start is None or fr.stop is None:
                raise ShardingError(f"{k!r}: flattened_range must be slice(start, stop), got {fr!r}")
            if not 0 <= fr.start < fr.stop <= math.prod(self.local_shape):
                raise ShardingError(
                    f"{k!r}: flattened_range {fr.start}:{fr.stop} is outside the flattened local shard of "
                    f"{math.prod(self.local_shape)} elements (local_shape={self.local_shape})"
                )
            if self.data is not None and (self.data.ndim != 1 or self.data.numel() != fr.stop - fr.start):
                raise ShardingError(
                    f"{k!r}: flattened data must be 1-D with {fr.stop - fr.start} elements, "
                    f"got {tuple(self.data.shape)}"
                )
        elif self.data is not None and tuple(self.data.shape) != self.local_shape:
            raise ShardingError(f"{k!r}: data shape {tuple(self.data.shape)} disagrees with "
                                f"local_shape {self.local_shape}")

    # -- constructors -------------------------------------------------------------------
    @classmethod
    def from_rank_offsets(
        cls,
        key: str,
        data: torch.Tensor,
        *rank_offsets: Tuple[int, int, int],
        replica_id: ReplicaId = 0,
        prepend_axis_num: int = 0,
        allow_shape_mismatch: bool = False,
        flattened_range: Optional[slice] = None,
        local_shape: Optional[Sequence[int]] = None,
    ) -> "ShardedTensor":
        """Shard evenly: each ``(axis, rank_on_axis, fragments_on_axis)`` of ``rank_offsets`` splits a global axis.

        ``(0, tp_rank, tp_size)`` means the global tensor is ``tp_size`` local tensors stacked along
        axis 0 and this one is number ``tp_rank``. Axes below ``prepend_axis_num`` are global-only.

        Args:
            key: the tensor's name in the checkpoint.
            data: this rank's local tensor.
            rank_offsets: ``(axis, rank_on_axis, fragments_on_axis)`` per sharded global axis.
            replica_id: 0 on the replica that writes; any other value on the others.
            prepend_axis_num: leading global axes this rank holds one slice of.
            allow_shape_mismatch: a load may read into a tensor of another shape (padded vocabularies).
            flattened_range: ``data`` is this 1-D range of the flattened local shard.
            local_shape: the local shard's shape where ``data`` is flattened.

        Returns:
            The ShardedTensor.

        Raises:
            ShardingError: an offset out of range, an axis twice, or ``data`` no tensor.
        """
        _require_tensor(key, data)
        local_shape = tuple(local_shape) if local_shape is not None else tuple(data.shape)
        ndim = prepend_axis_num + len(local_shape)
        global_shape = [1] * prepend_axis_num + list(local_shape)
        global_offset = [0] * ndim
        fragments = [1] * ndim
        seen = set()
        for entry in rank_offsets:
            if len(entry) != 3:
                raise ShardingError(f"{key!r}: rank offset must be (axis, rank, fragments), got {entry!r}")
            axis, rank, frags = (int(v) for v in entry)
            if not 0 <= axis < ndim:
                raise ShardingError(f"{key!r}: rank offset axis {axis} out of range for {ndim} global axes")
            if axis in seen:
                raise ShardingError(f"{key!r}: axis {axis} appears twice in rank offsets {rank_offsets}")
            if frags < 1 or not 0 <= rank < frags:
                raise ShardingError(f"{key!r}: axis {axis}: rank {rank} is not in [0, {frags})")
            seen.add(axis)
            size = 1 if axis < prepend_axis_num else local_shape[axis - prepend_axis_num]
            global_shape[axis] = size * frags
            global_offset[axis] = size * rank
            fragments[axis] = frags
        return cls(
            key=key,
            data=data,
            dtype=data.dtype,
            local_shape=local_shape,
            global_shape=tuple(global_shape),
            global_offset=tuple(global_offset),
            axis_fragmentations=tuple(fragments),
            replica_id=replica_id,
            prepend_axis_num=prepend_axis_num,
            allow_shape_mismatch=allow_shape_mismatch,
            flattened_range=flattened_range,
        )

    @classmethod
    def from_rank_offsets_flat(
        cls,
        key: str,
        data: torch.Tensor,
        non_flat_local_shape: Sequence[int],
        *rank_offsets: Tuple[int, int, int],
        flattened_range: slice,
        replica_id: ReplicaId = 0,
        prepend_axis_num: int = 0,
        allow_shape_mismatch: bool = False,
    ) -> "ShardedTensor":
        """Like :meth:`from_rank_offsets` for a 1-D ``data`` holding ``flattened_range`` of the
        flattened local shard of shape ``non_flat_local_shape`` (distributed-optimizer layout); ``key``,
        ``rank_offsets``, ``replica_id``, ``prepend_axis_num`` and ``allow_shape_mismatch`` as there."""
        return cls.from_rank_offsets(
            key,
            data,
            *rank_offsets,
            replica_id=replica_id,
            prepend_axis_num=prepend_axis_num,
            allow_shape_mismatch=allow_shape_mismatch,
            flattened_range=flattened_range,
            local_shape=tuple(non_flat_local_shape),
        )

    @classmethod
    def from_offsets(
        cls,
        key: str,
        data: torch.Tensor,
        global_shape: Sequence[int],
        global_offset: Sequence[int],
        *,
        replica_id: ReplicaId = 0,
        prepend_axis_num: int = 0,
        allow_shape_mismatch: bool = False,
    ) -> "ShardedTensor":
        """Place ``data`` at ``global_offset`` of a ``global_shape`` tensor named ``key`` (uneven shardings);
        ``replica_id``, ``prepend_axis_num`` and ``allow_shape_mismatch`` as in :meth:`from_rank_offsets`."""
        _require_tensor(key, data)
        return cls(
            key=key,
            data=data,
            dtype=data.dtype,
            local_shape=tuple(data.shape),
            global_shape=tuple(global_shape),
            global_offset=tuple(global_offset),
            replica_id=replica_id,
            prepend_axis_num=prepend_axis_num,
            allow_shape_mismatch=allow_shape_mismatch,
        )

    # -- derived views ------------------------------------------------------------------
    @property
    def shard_shape(self) -> Tuple[int, ...]:
        """Shape of the shard in global axes (1 on each prepended axis)."""
        return (1,) * self.prepend_axis_num + tuple(self.local_shape)

    @property
    def is_main_replica(self) -> bool:
        return is_main_replica(self.replica_id)

    def local_nbytes(self) -> int:
        """The bytes this rank's shard stores (its flattened range where it has one)."""
        n = ((self.flattened_range.stop - self.flattened_range.start) if self.flattened_range
             else math.prod(self.local_shape))
        return n * self.dtype.itemsize

    def __repr__(self) -> str:
        flat = (f", flattened_range={self.flattened_range.start}:{self.flattened_range.stop}" if self.flattened_range
                else "")
        return (
            f"ShardedTensor(key={self.key!r}, dtype={self.dtype}, local_shape={self.local_shape}, "
            f"global_shape={self.global_shape}, global_offset={self.global_offset}, replica_id={self.replica_id}{flat})"
        )


@dataclass
class ShardedObject(MegatronObjectMethods):
    """One element of a global N-d array of picklable objects (e.g. per-rank RNG states).

    The object is saved with ``torch.save`` and loaded with ``weights_only=True``: it must be made
    of tensors, containers, primitives and the allow-listed types.

    Attributes:
        key: name of the object array in the checkpoint (a non-empty str, else a ShardingError).
        data: this element's object (``None`` in a metadata-only description).
        global_shape: the shape of the object array, e.g. ``(world_size,)``.
        global_offset: this element's index in it (as long as ``global_shape``, else a ShardingError).
        replica_id: all zeros marks the main replica, the one saved; other values mark copies of it
            (a non-negative int or tuple of them, else a ShardingError).
    """

    key: str
    data: Any
    global_shape: Tuple[int, ...]
    global_offset: Tuple[int, ...]
    replica_id: ReplicaId = 0

    def __post_init__(self) -> None:
        _check_key("ShardedObject", self.key)
        self.global_shape = tuple(int(s) for s in self.global_shape)
        self.global_offset = tuple(int(s) for s in self.global_offset)
        self.replica_id = _check_replica_id(self.key, self.replica_id)
        if len(self.global_shape) != len(self.global_offset):
            raise ShardingError(
                f"{self.key!r}: global_shape {self.global_shape} and global_offset {self.global_offset} "
                "differ in length"
            )
        for ax, (off, size) in enumerate(zip(self.global_offset, self.global_shape)):
            if size < 1 or not 0 <= off < size:
                raise ShardingError(f"{self.key!r}: axis {ax}: offset {off} outside object array of size {size}")

    @property
    def is_main_replica(self) -> bool:
        return is_main_replica(self.replica_id)


@dataclass
class LocalNonpersistentObject:
    """A local value that is never saved; ``load`` puts ``obj`` back in its place."""

    obj: Any

    def unwrap(self) -> Any:
        """The wrapped object, as the load puts it back."""
        return self.obj


FactoryBuildFn = Callable[..., Any]
FactoryMergeFn = Callable[[Any], torch.Tensor]


@dataclass
class ShardedTensorFactory(MegatronFactoryMethods):
    """A deferred transform of a local tensor into a sub state dict of sharded entries.

    On save ``build_fn(key, data, replica_id, flattened_range)`` returns a nested dict/list of
    ShardedTensors / ShardedObjects / factories, which are saved in its place. On load the same
    expansion is the template of what is read, and ``merge_fn(loaded_sub_dict)`` turns the
    loaded sub dict back into the local tensor.
    """

    key: str
    data: torch.Tensor
    build_fn: FactoryBuildFn
    merge_fn: FactoryMergeFn
    replica_id: ReplicaId = 0
    flattened_range: Optional[slice] = None

    def __post_init__(self) -> None:
        _check_key("ShardedTensorFactory", self.key)
        self.replica_id = _check_replica_id(self.key, self.replica_id)
        if not callable(self.build_fn) or not callable(self.merge_fn):
            raise ShardingError(f"{self.key!r}: build_fn and merge_fn must be callable")

    def build(self) -> Any:
        """``build_fn(key, data, replica_id, flattened_range)``: the sharded entries saved in its place."""
        return self.build_fn(self.key, self.data, self.replica_id, self.flattened_range)

