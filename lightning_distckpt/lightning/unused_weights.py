"""A checkpoint's module weights that no rank asks for, refused where stock refuses them.

Stock Lightning reads a whole checkpoint, calls ``LightningModule.on_load_checkpoint`` on it, and only then
``load_state_dict(checkpoint["state_dict"], strict=True)``, whose pre-hooks may drop or rename keys too: a
hook that drops a removed head's weights makes a strict resume pass. Our strategies read the module's shards
in place, before those hooks, so the read only finds these weights (``refusing_unused(keys, found)``) and
leaves a placeholder for each under its state-dict name (a ``meta`` tensor of the stored shape and dtype:
never read, no memory); the module's ``load_state_dict`` then sees the keys stock's sees, after the user's
hooks, and those placeholders it would call unexpected are refused in the read's words, on every rank alike.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Dict, FrozenSet, Iterator, List, Optional, Sequence, Set

import torch
from torch.nn import Module

from ..core.errors import FormatError, MissingKeysError
from ..core.strict import refuse_unused
from ..reading.checkpoint import CheckpointSource
from ..storage.chunk_reads import torch_dtype
from .sharded import describe_source
from .tree import manifest_paths


@dataclass
class UnusedWeights:
    """The placeholders of one load: state-dict name -> stored key, per module entry."""

    path: str
    names: Dict[str, Dict[str, str]] = field(default_factory=dict)

    def refused(self, entry: str, unexpected: Sequence[str]) -> Set[str]:
        """The stored keys of ``entry``'s placeholders among a ``load_state_dict``'s ``unexpected`` keys."""
        names = self.names.get(entry, {})
        return {names[k] for k in unexpected if k in names}


def module_entry_keys(source: CheckpointSource, entries: Sequence[str],
                      extra_safe_globals: Sequence[Any] = ()) -> FrozenSet[str]:
    """The checkpoint's stored keys in its module entries ``entries`` (a Trainer's ``state_dict``, a Fabric
    state's module names): where its manifest places them (our layouts), else keys under an entry by tree path
    (``state_dict/layer.weight``: a ``torch.save`` file, the plugin's or a ModelParallel directory) or by a
    Fabric module's prefix (``model.``: a factory's expansions and ShardedObjects, which no manifest lists).
    From the checkpoint's metadata and common state only: the same on every rank."""
    placed = _manifest_places(source, extra_safe_globals)
    prefixes = tuple(f"{entry}{sep}" for entry in entries for sep in "/.")
    firsts = {("d", entry) for entry in entries}
    keys = [*source.index.tensors, *source.index.objects]
    return frozenset(k for k in keys if (bool(placed[k]) and placed[k][0] in firsts if k in placed
                                         else k.startswith(prefixes)))


def _manifest_places(source: CheckpointSource, extra_safe_globals: Sequence[Any]) -> Dict[str, Any]:
    """Stored key -> its path in the saved tree, where the checkpoint's manifest places it (our layouts); {} for
    others, or where the manifest is refused (by the load's own checks where it matters: here keys go by name)."""
    try:
        man = describe_source(source, extra_safe_globals).manifest
        return manifest_paths(man, source.path) if man is not None else {}
    except FormatError:
        return {}


def placeholders(source: CheckpointSource, found: Set[str], entry: str,
                 extra_safe_globals: Sequence[Any] = ()) -> Dict[str, Any]:
    """stored key -> (state-dict name, placeholder) for those of ``found`` (stored keys no rank asks for) in the
    module entry ``entry``: the name where the manifest places the key at ``entry``'s first level, else the key
    without ``entry/`` or ``entry.``. A key that has no such name is refused now, as the read would have."""
    placed = _manifest_places(source, extra_safe_globals)
    out: Dict[str, Any] = {}
    for key in sorted(found):
        steps = placed.get(key)
        if steps is not None:
            name = steps[1][1] if len(steps) == 2 and tuple(steps[0]) == ("d", entry) else None
        else:
            name = next((key[len(entry) + 1:] for sep in "/." if key.startswith(entry + sep)), None)
        if not isinstance(name, str):  # no state-dict name a hook could drop: refused as the read refuses it
            refuse_unused(source.path, found)
        out[key] = (name, _placeholder(source, key))
    return out


def _placeholder(source: CheckpointSource, key: str) -> Any:
    """A ``meta`` tensor of the stored tensor's shape and dtype (an object: None), never read."""
    entry = source.index.tensors.get(key)
    if entry is None:
        return None
    dtype = torch_dtype(str(entry.dtype)) or torch.float32  # a dtype torch lacks: the shape is what a hook reads
    return torch.empty(tuple(entry.global_shape), dtype=dtype, device="meta")


def insert_placeholders(unused: UnusedWeights, entry: str, state_dict: Dict[str, Any],
                        found: Dict[str, Any]) -> None:
    """Put ``found`` (:func:`placeholders`) into the loaded ``state_dict`` of ``entry`` and record them."""
    names = unused.names.setdefault(entry, {})
    for key, (name, value) in found.items():
        state_dict[name] = value
        names[name] = key


@contextlib.contextmanager
def refusing_placeholders(module: Module, unused: Optional[UnusedWeights], entry: str, strict: bool) -> Iterator[None]:
    """Around ``module.load_state_dict`` (stock's own call, after the user's hooks): the placeholders it finds
    unexpected are taken off its list and, where ``strict``, refused in the read's words once it returned; what
    else it finds is its own (torch's error, as stock)."""
    if unused is None or not unused.names.get(entry):
        yield
        return
    left: List[str] = []

    def take_placeholders(_: Module, incompatible: Any) -> None:
        # torch lets a post-hook edit the lists before its strict check
        mine = unused.refused(entry, incompatible.unexpected_keys)
        left.extend(mine)
        incompatible.unexpected_keys[:] = [k for k in incompatible.unexpected_keys
                                           if k not in unused.names[entry]]

    def refuse_left_out(_: Module, state_dict: Dict[str, Any], prefix: str, *__: Any) -> None:
        # registered last on the root: after the user's pre-hooks, before anything is copied. A placeholder at a
        # name the module's own state dict has (its sharded_state_dict leaves that tensor out) would be copied
        # from a meta tensor; stock loads the stored value, which this read did not: say so
        own = set(module.state_dict(keep_vars=True))
        names = unused.names[entry]
        left_out = sorted(n for n, v in state_dict.items() if n in names and n[len(prefix):] in own
                          and isinstance(v, torch.Tensor) and v.is_meta)
        if left_out:
            raise MissingKeysError(
                f"checkpoint {unused.path}: its module weights {sorted(names[n] for n in left_out)} were not read: "
                f"{type(module).__name__}.sharded_state_dict() leaves out {left_out}, which its state_dict() and "
                "load_state_dict(strict=True) have (stock Lightning loads them from the checkpoint). Describe them in "
                "sharded_state_dict() to restore them, or set strict_loading = False / fabric.load(..., strict=False) "
                "to keep the module's own values")

    handles = [module.register_load_state_dict_post_hook(take_placeholders),
               module.register_load_state_dict_pre_hook(refuse_left_out)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
    if strict:
        refuse_unused(unused.path, set(left))
