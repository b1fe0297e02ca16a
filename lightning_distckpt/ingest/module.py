"""``DistModule``: ``load_state_dict`` of a whole state dict held by rank 0 into a sharded module."""

from __future__ import annotations

from typing import AbstractSet, Any, Dict, List, Mapping, Optional, Tuple, Union

import torch
from torch import nn
from torch.nn.modules.module import _IncompatibleKeys

from ..comm import get_comm
from ..core.errors import ArgumentTypeError, CheckpointingError, MissingKeysError, ShardingError, ValidationError
from ..core.mapping import ShardedTensor
from .plan import describe_source
from ..reading.tied import same_values, tie_groups
from .api import DEFAULT_BUCKET_BYTES, DEFAULT_MAX_INFLIGHT_BYTES, ShardOptions, shard_from_rank0


_OWN = ("module", "options")  # attributes of the wrapper itself; everything else is the wrapped module's


class DistModule(nn.Module):
    """Wraps ``module`` so that ``load_state_dict`` takes the full state dict on global rank 0
    (``{}`` on the others) and gives every rank its shards.

    The shards follow ``module.sharded_state_dict()`` when the module defines it, else
    :func:`~lightning_distckpt.lightning.module_sharded_state_dict` (submodules that define one, such as
    tensor-parallel layers, describe their shards; every other tensor is loaded whole on every
    rank). Attribute access, attribute setting, ``forward`` and ``state_dict`` go to the wrapped
    module, so the wrapper can stand in for it.

    Args:
        module: the module to wrap; it may be built on the meta device (then load with
            ``assign=True``).
        max_inflight_bytes, bucket_bytes: see :class:`~lightning_distckpt.ingest.ShardOptions`.
    """

    def __init__(self, module: nn.Module, *, max_inflight_bytes: int = DEFAULT_MAX_INFLIGHT_BYTES,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise ArgumentTypeError(f"DistModule wraps an nn.Module, got {type(module).__name__}")
        nn.Module.__setattr__(self, "module", module)
        nn.Module.__setattr__(self, "options", ShardOptions(max_inflight_bytes, bucket_bytes))

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            # Through __dict__: while the wrapper is half-built (copy, unpickling) there is no
            # wrapped module yet, and looking it up through attributes would recurse.
            wrapped = self.__dict__.get("_modules", {}).get("module")
            if wrapped is None:
                raise
            return getattr(wrapped, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _OWN or name in self.__dict__:
            nn.Module.__setattr__(self, name, value)
        else:
            setattr(self._modules["module"], name, value)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def state_dict(self, *args: Any, **kwargs: Any) -> Dict[str, Any]:  # type: ignore[override]
        """The wrapped module's ``state_dict`` (its keys, without a wrapper prefix)."""
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True,  # type: ignore[override]
                        assign: bool = False) -> _IncompatibleKeys:
        """Load the full ``state_dict`` given on rank 0 (``{}`` elsewhere; ignored there) into
        every rank's shards. Collective over the default process group.

        With ``strict``, keys the module has and rank 0's state dict lacks, or the reverse, or that
        its sharded state dict describes no shard for, fail every rank (``MissingKeysError``) before
        any data moves; so does an entry whose shard cannot take the place of the module's tensor
        (``ShardingError``): the module is left as it was. Tied tensors (one tensor of the module
        under several names) stay one tensor with ``assign`` when rank 0 gives them equal values,
        and one the state dict lacks takes its twin's (a tied embedding saved once). ``assign`` as
        in ``nn.Module.load_state_dict`` (needed for a module on the meta device). Returns torch's
        ``_IncompatibleKeys``, the same on every rank.
        """
        comm = get_comm()
        meta = {name: entry for name, entry in _sharded_state_dict(self.module).items()
                if isinstance(entry, ShardedTensor)}
        error = _unloadable(self.module, meta, strict)
        missing_ok: Union[bool, AbstractSet[str]] = not strict
        if comm.rank == 0 and error is None:  # rank 0's error fails every rank in the first collective
            missing_ok, error = _tied_twins(meta, state_dict, strict)
        shards: Dict[str, Any] = {}
        result = shard_from_rank0(comm, state_dict if comm.rank == 0 else None, meta, shards, self.options,
                                  missing_ok=missing_ok, unexpected_ok=not strict, error=error)
        _tie(meta, shards)
        out = self.module.load_state_dict(shards, strict=False, assign=assign)
        return _IncompatibleKeys(list(out.missing_keys), list(result.unexpected))


def _unloadable(module: nn.Module, meta: Mapping[str, ShardedTensor], strict: bool) -> Optional[CheckpointingError]:
    """Why ``module.load_state_dict`` would fail on the shards of ``meta``, checked before any data moves
    (the ranks agree on it first): found by torch's load itself, the module's other tensors were already
    overwritten. A shard of another shape than the module's tensor of its name; with ``strict``, a key of
    the module that no entry fills (a tensor its ``sharded_state_dict`` leaves out, non-tensor extra state)."""
    what = f"DistModule.load_state_dict: {type(module).__name__}"
    try:
        own = module.state_dict(keep_vars=True)
        for name, entry in meta.items():
            value = own.get(name)
            fr = entry.flattened_range
            shape = tuple(entry.local_shape) if fr is None else (fr.stop - fr.start,)
            if isinstance(value, torch.Tensor) and tuple(value.shape) != shape:
                raise ShardingError(f"{what}'s {name!r} has shape {tuple(value.shape)}, but its sharded state dict "
                                    f"entry (key {entry.key!r}) makes a shard of shape {shape}")
        unfilled = [k for k in own if k not in meta]
        if strict and unfilled:
            extra = any(k.endswith("_extra_state") and not isinstance(own[k], torch.Tensor) for k in unfilled)
            raise MissingKeysError(f"{what} has key(s) that no sharded state dict entry fills: {unfilled[:10]}"
                                   + (" (non-tensor extra state is not transferred: load with strict=False and "
                                      "set it yourself)" if extra else ""))
    except CheckpointingError as e:
        return e
    return None


def _tied_twins(meta: Mapping[str, ShardedTensor], state_dict: Mapping[str, Any],
                strict: bool) -> Tuple[Union[bool, AbstractSet[str]], Optional[CheckpointingError]]:
    """Rank 0, before any data moves: what a strict load may find missing (names tied to one the state
    dict holds: a tied embedding saved once, filled from its twin by :func:`_tie`), and why the load must
    fail: tied names the state dict holds with different values (one tensor cannot keep both)."""
    if not isinstance(state_dict, Mapping):
        return not strict, None  # shard_from_rank0 names the wrong argument
    allowed = set()
    for names in _tied_names(meta):
        held = [n for n in names if meta[n].key in state_dict]
        if held:
            allowed |= {meta[n].key for n in names if n not in held}
        first = state_dict[meta[held[0]].key] if held else None
        for n in held[1:]:
            other = state_dict[meta[n].key]
            if isinstance(first, torch.Tensor) and isinstance(other, torch.Tensor) and not same_values(first, other):
                return allowed, ValidationError(
                    f"DistModule.load_state_dict: {meta[held[0]].key!r} and {meta[n].key!r} are one tensor in the "
                    f"module (tied weights) but {describe_source(state_dict)} holds different values for them; "
                    f"untie them in the module, or drop one of the two keys")
    return (True if not strict else allowed), None


def _tied_names(meta: Mapping[str, ShardedTensor]) -> List[List[str]]:
    """Names whose entries hold one tensor of the module (tied weights), groups of two or more."""
    names = list(meta)
    return [[names[p] for p in g] for g in tie_groups(list(meta.values()))]


def _tie(meta: Mapping[str, ShardedTensor], shards: Dict[str, Any]) -> None:
    """Names whose entries hold one tensor of the module (tied weights): one shard for all of them, as torch's
    own load keeps the storage they share, where the values loaded are equal (the same tensor saved under
    both names) or only one of them was loaded (saved once, as Hugging Face saves a tied embedding)."""
    for names in _tied_names(meta):
        loaded = [n for n in names if n in shards]
        if not loaded:
            continue
        first = shards[loaded[0]]
        if all(same_values(first, shards[n]) for n in loaded[1:]):
            for n in names:
                shards[n] = first


def _sharded_state_dict(module: nn.Module) -> Dict[str, Any]:
    """The module's own ``sharded_state_dict()``, else the generic one built from its submodules."""
    own = getattr(module, "sharded_state_dict", None)
    if callable(own):
        return own()
    from ..lightning.parallel import module_sharded_state_dict  # imports Lightning: only when needed

    return module_sharded_state_dict(module)
