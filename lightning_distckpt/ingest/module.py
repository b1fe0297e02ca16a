"""``DistModule``: ``load_state_dict`` of a whole state dict held by rank 0 into a sharded module."""

from __future__ import annotations

from typing import Any, Dict, Mapping

from torch import nn
from torch.nn.modules.module import _IncompatibleKeys

from ..comm import get_comm
from ..core.errors import ArgumentTypeError, MissingKeysError
from ..core.mapping import ShardedTensor
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

        With ``strict``, keys the module has and rank 0's state dict lacks, or the reverse, fail
        every rank (``MissingKeysError``) before any data moves. ``assign`` as in
        ``nn.Module.load_state_dict`` (needed for a module on the meta device). Returns torch's
        ``_IncompatibleKeys``, the same on every rank.
        """
        comm = get_comm()
        meta = {name: entry for name, entry in _sharded_state_dict(self.module).items()
                if isinstance(entry, ShardedTensor)}
        shards: Dict[str, Any] = {}
        result = shard_from_rank0(comm, state_dict if comm.rank == 0 else None, meta, shards, self.options,
                                  missing_ok=not strict, unexpected_ok=not strict)
        out = self.module.load_state_dict(shards, strict=False, assign=assign)
        missing = list(out.missing_keys)
        if strict and missing:
            raise MissingKeysError(f"DistModule.load_state_dict: {type(self.module).__name__} has key(s) that no "
                                   f"sharded state dict entry filled: {missing[:10]}")
        return _IncompatibleKeys(missing, list(result.unexpected))


def _sharded_state_dict(module: nn.Module) -> Dict[str, Any]:
    """The module's own ``sharded_state_dict()``, else the generic one built from its submodules."""
    own = getattr(module, "sharded_state_dict", None)
    if callable(own):
        return own()
    from ..lightning.parallel import module_sharded_state_dict  # imports Lightning: only when needed

    return module_sharded_state_dict(module)
