"""Plain ``torch.Tensor`` leaves as replicated sharded tensors, on save and on load (as PyTorch DCP stores them).

A plain tensor leaf of a state dict (not a DTensor; not inside a ShardedTensor, ShardedObject,
LocalNonpersistentObject or factory, which are leaves; not inside a tuple, which is common state
as a whole) is the whole tensor, the same on every rank. :func:`shard_tensors` replaces it by a
:class:`PlainTensorFactory` keyed by its tree path, the key DTensor leaves get
(:mod:`.tree_paths`: ``{"model": {"w": t}}`` -> ``"model/w"``), whose expansion is
``ShardedTensor.from_rank_offsets(key, t, replica_id=rank)``: stored once, by one of the ranks
(spread like any replicated shard), checksummed, read straight into the template's tensor on load,
resharded like any other. Like any replicated shard, its value is taken from the rank that writes it:
every rank must hold the same value (as DCP assumes).

The factory keeps the leaf's steps: a save records them in ``metadata.json`` (``plain_tensors``), so a
load puts each such tensor back at its place when the template has none there, as the common state
always came back; a template's plain tensor whose key a checkpoint written before lacks is filled
from that checkpoint's common state (``reading/plain_tensors.py``).

What the store cannot hold stays common state, as before: a tensor subclass other than
``nn.Parameter``, a sparse or meta tensor, a dtype ``metadata.json`` has no name for (complex32,
float8_e8m0fnu, ...: ``planning/dtypes.py`` lists those it has), a path with a dict key other than a
str or an int (JSON would not give its place back), or a key that cannot name a stored array
(``"."``, ``".."``).
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass
from typing import Any, Optional

import torch

from .errors import ShardingError
from .mapping import ReplicaId, ShardedTensor, ShardedTensorFactory
from .tree_paths import JSON_KEYS, Steps, key_by_path, path_key
from ..planning.metadata import dtype_name  # the dtypes metadata.json can name

_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)


@dataclass
class PlainTensorFactory(ShardedTensorFactory):
    """The factory of a plain tensor leaf: ``steps`` is its place in the tree (``key`` joins them)."""

    steps: Steps = ()


class RefusedState(dict):
    """In place of a state dict this rank could not shard (:func:`shard_tensors` raised: two leaves giving
    one key, say): a save raises its error where it agrees errors (``saving/save_prepare._describe``), so
    the other ranks are not left waiting in a later collective."""

    def __init__(self, error: Exception) -> None:
        super().__init__()
        self.error = error


def tree_to_save(tree: Any, rank: int, size: int) -> Any:
    """A save's state dict as every saver takes it: Megatron-Core's leaves as ours, DTensors and plain tensor
    leaves as sharded tensors keyed by tree path (:func:`shard_tensors`). This rank's tree alone may be wrong
    (two leaves giving one key): among several ranks a :class:`RefusedState`, raised by the save's handshake
    on every rank; alone, raised here."""
    from .megatron_leaves import from_megatron_leaves

    try:
        return shard_tensors(from_megatron_leaves(tree), rank)
    except Exception as e:
        if size == 1:
            raise
        return RefusedState(e)


def shard_tensors(tree: Any, rank: int) -> Any:
    """``tree`` with each DTensor leaf replaced by its factory (:func:`~.dtensors.shard_dtensors`) and
    each plain tensor leaf that can be stored by a :class:`PlainTensorFactory` replicated over the
    ranks (``replica_id=rank``). Containers on the way are copied (dicts as plain dicts); a tree with
    neither is returned as it is. Two leaves whose paths give one key: ShardingError naming both."""
    replica = max(int(rank), 0)
    dtensor = _dtensor_class()

    def convert(steps: Steps, node: Any) -> Optional[ShardedTensorFactory]:
        if dtensor is not None and isinstance(node, dtensor):
            from .dtensors import dtensor_factory

            return dtensor_factory(steps, node)
        key = storable_key(steps, node) if type(node) in _PLAIN_TYPES else None
        if key is None:
            return None
        return PlainTensorFactory(key=key, data=node, build_fn=_build, merge_fn=functools.partial(restore_plain, node),
                                  replica_id=replica, steps=steps)

    return key_by_path(tree, convert)


def _dtensor_class() -> Optional[type]:
    """torch's ``DTensor``, if ``torch.distributed.tensor`` was imported: no DTensor can exist before.
    Importing it costs about 0.7 s (sympy, the op registrations), which the command line and a
    process that never made a DTensor need not pay."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None)


def storable_key(steps: Steps, tensor: torch.Tensor) -> Optional[str]:
    """The key the plain tensor at ``steps`` is stored under, or None where it stays common state
    (see the module docstring)."""
    if tensor.layout != torch.strided or tensor.is_meta or not _named_dtype(tensor.dtype):
        return None
    for kind, k in steps:  # in a tuple, or a key JSON would not give back as it was
        if kind == "t" or type(k) not in JSON_KEYS:
            return None
    key = path_key(steps)
    return None if key in (".", "..") else key


@functools.lru_cache(maxsize=None)
def _named_dtype(dtype: torch.dtype) -> bool:
    try:
        dtype_name(dtype)
    except ShardingError:
        return False
    return True


def _build(key: str, data: torch.Tensor, replica_id: ReplicaId, flattened_range: Optional[slice]) -> ShardedTensor:
    """The whole tensor, replicated: main on rank 0, written by one of its holders."""
    return ShardedTensor.from_rank_offsets(key, data.detach(), replica_id=replica_id)


def restore_plain(template: torch.Tensor, loaded: Any) -> torch.Tensor:
    """``template`` holding the loaded values (copied in unless they were read into it in place)."""
    target = template.detach()
    if isinstance(loaded, torch.Tensor) and not same_memory(loaded, target):
        with torch.no_grad():
            target.copy_(loaded)
    return template


def same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` are the same view of the same memory (a read went straight into it)."""
    return (a.device == b.device and a.data_ptr() == b.data_ptr() and a.shape == b.shape
            and a.stride() == b.stride() and a.dtype == b.dtype)
