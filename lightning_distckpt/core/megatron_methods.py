"""The methods Megatron-Core's ``ShardedTensor`` / ``ShardedObject`` / ``ShardedTensorFactory`` have and
code written for it calls (``without_data``, ``narrow``, ``init_data``, ``unique_key``, ...), with its
signatures and results, as mixins of :mod:`lightning_distckpt.core.mapping`'s dataclasses (kept here so
the data model's module stays the data model). Where Megatron-Core asserts, ours raises a
``ShardingError`` naming the key."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, List, Tuple, Union

import torch

from .errors import ShardingError


class MegatronTensorMethods:
    """Megatron-Core 0.16's ``ShardedTensor`` methods, for ours."""

    key: str
    data: Any
    dtype: Any
    local_shape: Tuple[int, ...]
    global_shape: Tuple[int, ...]
    global_offset: Tuple[int, ...]
    axis_fragmentations: Any
    prepend_axis_num: int
    flattened_range: Any

    def without_data(self) -> Any:
        """A copy describing the same shard, with ``data=None`` (as Megatron-Core's)."""
        return replace(self, data=None)  # type: ignore[type-var]

    def init_data(self, device: Union[str, torch.device], init_fn: Any = torch.empty) -> None:
        """Allocate ``data`` (``init_fn(local_shape, dtype=, device=)``) when it is None; else nothing."""
        if self.data is not None:
            return
        # a flat shard holds its slice of the flattened local shard, 1-D (Megatron-Core <= 0.15 did the same)
        shape = ((self.flattened_range.stop - self.flattened_range.start,) if self.flattened_range is not None
                 else self.local_shape)
        self.data = init_fn(shape, dtype=self.dtype, device=device)

    @property
    def has_regular_grid(self) -> bool:
        """Whether the shards form a regular grid (built by ``from_rank_offsets``)."""
        return self.axis_fragmentations is not None

    def global_slice(self) -> Tuple[Union[int, slice], ...]:
        """The index of this shard in the global tensor: an int per prepended axis, then slices."""
        n = self.prepend_axis_num
        return tuple(self.global_offset[:n]) + tuple(
            slice(off, off + size) for off, size in zip(self.global_offset[n:], self.local_shape))

    def local_chunk_offset_in_global(self) -> Tuple[int, ...]:
        """This shard's index in the global grid of shards (offset // shard size on each axis)."""
        n = self.prepend_axis_num
        for off, size in zip(self.global_offset[n:], self.local_shape):
            if size == 0 or off % size:
                raise ShardingError(f"{self.key!r}: offset {self.global_offset} is not on a grid of shards of "
                                    f"{self.local_shape}")
        return tuple(self.global_offset[:n]) + tuple(
            off // size for off, size in zip(self.global_offset[n:], self.local_shape))

    def max_allowed_chunks(self) -> Tuple[int, ...]:
        """The size of one fragment on each global axis (global size // fragments)."""
        if self.axis_fragmentations is None:
            raise ShardingError(f"{self.key!r}: no regular grid of shards (built with from_offsets)")
        return tuple(size // frags for size, frags in zip(self.global_shape, self.axis_fragmentations))

    def validate_metadata_integrity(self) -> None:
        """Checked at construction already (a ShardingError then); kept for Megatron-Core's callers."""

    def narrow(self, dim: int, start: int, length: int) -> List[Any]:
        """``torch.narrow`` of the local tensor along local axis ``dim``, every rank alike: the global
        tensor shrinks by the same ratio. One ShardedTensor in a list (as Megatron-Core's)."""
        if self.flattened_range is not None or self.data is None:
            raise ShardingError(f"{self.key!r}: narrow needs the local tensor's data, not flattened")
        axis, local = dim + self.prepend_axis_num, self.local_shape[dim]
        if local == 0 or self.global_shape[axis] % local or self.global_offset[axis] % local:
            raise ShardingError(f"{self.key!r}: narrow needs a regular grid of shards along axis {axis}, got "
                                f"global_shape={self.global_shape}, global_offset={self.global_offset}")
        data = self.data.narrow(dim, start, length)
        shape, offset = list(self.global_shape), list(self.global_offset)
        shape[axis] = shape[axis] // local * length
        offset[axis] = offset[axis] // local * length
        return [replace(self, data=data, local_shape=tuple(data.shape),  # type: ignore[type-var]
                        global_shape=tuple(shape), global_offset=tuple(offset))]


class MegatronObjectMethods:
    """Megatron-Core 0.16's ``ShardedObject`` methods, for ours."""

    key: str
    global_shape: Tuple[int, ...]
    global_offset: Tuple[int, ...]

    @property
    def unique_key(self) -> str:
        """``<key>/shard_<offset>_<global shape>``, ``.``-joined: Megatron-Core's name of this element."""
        return (f"{self.key}/shard_{'.'.join(map(str, self.global_offset))}_"
                f"{'.'.join(map(str, self.global_shape))}")

    @classmethod
    def empty_from_unique_key(cls, unique_key: str, replica_id: Any = 0) -> Any:
        """The element a :attr:`unique_key` names, without data."""
        key, _, shard = unique_key.rpartition("/")
        parts = shard.split("_")
        if not key or len(parts) != 3 or parts[0] != "shard":
            raise ShardingError(f"{unique_key!r} is not a ShardedObject unique key <key>/shard_<offset>_<shape>")
        try:
            offset, shape = (tuple(int(v) for v in p.split(".")) for p in parts[1:])
        except ValueError:
            raise ShardingError(f"{unique_key!r}: offset and shape must be '.'-joined ints") from None
        return cls(key, None, shape, offset, replica_id)  # type: ignore[call-arg]

    def without_data(self) -> Any:
        """A copy describing the same element, with ``data=None``."""
        return replace(self, data=None)  # type: ignore[type-var]

    def validate_metadata_integrity(self) -> None:
        """Checked at construction already (a ShardingError then); kept for Megatron-Core's callers."""


class MegatronFactoryMethods:
    """Megatron-Core 0.16's ``ShardedTensorFactory`` methods, for ours."""

    def without_data(self) -> Any:
        """A copy with ``data=None`` (as Megatron-Core's; not buildable until data is set again)."""
        return replace(self, data=None)  # type: ignore[type-var]

    def validate_metadata_integrity(self) -> None:
        """Nothing to check before the factory is built (as Megatron-Core)."""
