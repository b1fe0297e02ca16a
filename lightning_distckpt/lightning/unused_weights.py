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
import logging
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Dict, FrozenSet, Iterator, List, Optional, Sequence, Set, Tuple

import torch
from torch.nn import Module

from ..comm import get_comm
from ..core.errors import CheckpointingError, FormatError, MissingKeysError
from ..core.mapping import ShardedTensor
from ..core.strict import StrictHandling, check_keys, refuse_unused
from ..reading.checkpoint import CheckpointSource
from ..storage.chunk_reads import torch_dtype
from .sharded import AlreadyAgreed, describe_source
from .tree import manifest_paths

log = logging.getLogger(__name__)


@dataclass
class UnusedWeights:
    """The placeholders of one load: state-dict name -> stored key, per module entry. ``read(entry, template)``:
    a collective read of ``{name: ShardedTensor}`` into that module entry (our strategy's load of the opened
    checkpoint), for placeholders a user's hook moved onto the module's keys (None: this restore reads none);
    ``templates``: per entry, the module's ShardedTensor of each state-dict name it read into."""

    path: str
    names: Dict[str, Dict[str, str]] = field(default_factory=dict)
    read: Optional[Callable[[str, Dict[str, Any]], Dict[str, Any]]] = None
    templates: Dict[str, Dict[str, ShardedTensor]] = field(default_factory=dict)
    stored_of: Dict[int, str] = field(default_factory=dict)  # id of a placeholder -> its stored key
    kept: List[Any] = field(default_factory=list)  # the placeholders themselves: their ids stay theirs
    # per entry, the module's names the checkpoint lacks -> their keys
    held: Dict[str, Dict[str, str]] = field(default_factory=dict)
    lenient: str = "strict_loading = False"  # the non-strict load in its caller's words, for the warnings

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
    without ``entry/`` or ``entry.``. A key of ``entry`` that has no such name is refused now, as the read would
    have; the keys of other entries (another module of a Fabric state) are theirs, left out here."""
    placed = _manifest_places(source, extra_safe_globals)
    out: Dict[str, Any] = {}
    for key in sorted(found):
        steps = placed.get(key)
        if steps is not None:
            if not steps or tuple(steps[0]) != ("d", entry):
                continue
            name = steps[1][1] if len(steps) == 2 else None
        else:
            name = next((key[len(entry) + 1:] for sep in "/." if key.startswith(entry + sep)), None)
            if name is None:
                continue
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
        if isinstance(value, torch.Tensor):
            unused.stored_of[id(value)] = key
            unused.kept.append(value)


def module_templates(template: Dict[str, Any], entries: Sequence[str]) -> Dict[str, Dict[str, ShardedTensor]]:
    """Per module entry of a load's ``template``, its first-level ShardedTensors by state-dict name
    (:attr:`UnusedWeights.templates`)."""
    return {entry: {name: st for name, st in template[entry].items() if isinstance(st, ShardedTensor)}
            for entry in entries if isinstance(template.get(entry), dict)}


def hold_absent(unused: UnusedWeights, loaded: Dict[str, Any], held: Set[str],
                refuse: Callable[[Set[str]], None], strict: bool = True) -> None:
    """The module's keys the checkpoint lacks, left by the read for after the user's hooks
    (:func:`~..core.strict.deferring_absent`): their names leave the loaded state dict of their module entry
    (``loaded[entry]``), so the module's ``load_state_dict`` reports them missing, as stock's does, unless a hook
    moved a placeholder there (a ``strict`` one refuses them, a non-strict one names them in its warning,
    :func:`refusing_placeholders`). A key that is no first-level ShardedTensor of a module entry
    (:attr:`UnusedWeights.templates`) has no name a hook could fill: where ``strict``, ``refuse`` gets every held
    key (the read's own refusal, as it would have been made); else those keys alone (logged by the read's mode:
    no hook can change them)."""
    named = {st.key: (entry, name) for entry, sts in unused.templates.items() for name, st in sts.items()}
    unnamed = {k for k in held if k not in named}
    if unnamed:  # refused now whatever the hooks do: with the rest, as the read refuses
        refuse(set(held) if strict else unnamed)  # (both sides together: a compiled submodule's beside its optimizer's)
    for key in set(held) - unnamed:
        entry, name = named[key]
        loaded[entry].pop(name, None)
        unused.held.setdefault(entry, {})[name] = key


@dataclass
class _Found:
    """What the stand-in hooks of one ``load_state_dict`` found (:func:`_stand_in`)."""

    moved: Dict[str, Tuple[str, torch.Tensor]] = field(default_factory=dict)  # name -> (stored key, its tensor)
    left_out: List[str] = field(default_factory=list)  # placeholders at their own names (not read)
    errors: List[Exception] = field(default_factory=list)


def _own_tensors(mod: Module) -> Dict[str, torch.Tensor]:
    """The tensors ``mod._load_from_state_dict`` copies into: its own parameters and persistent buffers."""
    buffers = {k: v for k, v in mod.named_buffers(recurse=False) if k not in mod._non_persistent_buffers_set}
    return {k: v for k, v in [*mod.named_parameters(recurse=False), *buffers.items()] if v is not None}


def _stand_in(unused: UnusedWeights, entry: str, strict: bool, found: _Found, mod: Module,
              state_dict: Dict[str, Any], prefix: str) -> None:
    """A ``load_state_dict`` pre-hook registered last on the module and each submodule (after the user's there,
    before that module's tensors are copied; torch hands a submodule only its own prefix's keys): a placeholder
    at one of this module's own names is replaced by the module's tensor there (copied onto itself) and
    recorded: one a hook moved there is read after every module's hooks ran (:func:`_read_moved`), checked here
    against the module's ShardedTensor; one still at its own name (``sharded_state_dict`` left it out, so it was
    not read) is refused where ``strict``, else the module keeps its own value."""
    for local, own in _own_tensors(mod).items():
        name = prefix + local
        value = state_dict.get(name)
        key = unused.stored_of.get(id(value)) if isinstance(value, torch.Tensor) else None
        if key is None:
            continue
        state_dict[name] = own
        if unused.names[entry].get(name) == key:
            found.left_out.append(name)
            continue
        st = unused.templates.get(entry, {}).get(name)
        if st is None or st.data is None or tuple(st.data.shape) != tuple(own.shape):
            found.errors.append(MissingKeysError(
                f"checkpoint {unused.path}: a hook put its weight {key!r} at {name!r}, which the module's "
                "sharded_state_dict() does not describe as a ShardedTensor of its own: it cannot be read there; "
                "rename the key in sharded_state_dict() instead"))
        elif tuple(value.shape) != tuple(st.global_shape) or value.dtype != st.dtype:
            found.errors.append(MissingKeysError(
                f"checkpoint {unused.path}: a hook put its weight {key!r} (shape {tuple(value.shape)}, "
                f"{value.dtype}) at {name!r}, whose tensor in the module is of shape {tuple(st.global_shape)}, "
                f"{st.dtype}"))
        found.moved[name] = (key, own)


def _left_out_error(module: Module, unused: UnusedWeights, entry: str, left_out: List[str]) -> MissingKeysError:
    """The refusal of placeholders still at their own names, which the module's state dict has: its
    sharded_state_dict leaves those tensors out, so they were not read, where stock loads the stored values."""
    names = unused.names[entry]
    return MissingKeysError(
        f"checkpoint {unused.path}: its module weights {sorted(names[n] for n in left_out)} were not read: "
        f"{type(module).__name__}.sharded_state_dict() leaves out {sorted(left_out)}, which its state_dict() and "
        "load_state_dict(strict=True) have (stock Lightning loads them from the checkpoint). Describe them in "
        "sharded_state_dict() to restore them, or set strict_loading = False / fabric.load(..., strict=False) "
        "to keep the module's own values")


def _read_moved(module: Module, unused: UnusedWeights, entry: str, strict: bool, found: _Found) -> None:
    """Collective, in the module's root ``load_state_dict`` post-hook (every module's pre-hooks ran, nothing
    checked yet): the placeholders the hooks moved onto module keys are read from the checkpoint under their
    stored keys, each into a tensor shaped as the module's shard there, and copied into it, as stock copies;
    the outcome agreed first (every rank runs the same hooks: ranks whose hooks moved different ones, or
    failed, raise alike; none waits)."""
    errors = list(found.errors)
    if found.left_out and strict:
        errors.insert(0, _left_out_error(module, unused, entry, found.left_out))
    elif found.left_out:
        log.warning("checkpoint %s: the module's %s keep their own values: its sharded_state_dict() leaves them "
                    "out, so the stored ones were not read (%s)", unused.path, sorted(found.left_out), unused.lenient)
    moved = sorted((name, key) for name, (key, _) in found.moved.items())
    if unused.read is None:  # a restore that reads no placeholder (a tier's): no collective here
        if moved and not errors:
            errors.append(CheckpointingError(
                f"checkpoint {unused.path}: a load_state_dict hook moved its stored weights onto the module's keys "
                f"({dict(moved)}), which this restore does not read; rename the keys in sharded_state_dict() "
                "instead"))
        if errors:
            raise errors[0]
        return
    try:
        gathered = get_comm().agree(f"restore of the module's weights from {unused.path} failed",
                                    errors[0] if errors else None, moved)
    except Exception as e:  # every rank raises it, in this agreement or the one it met
        raise AlreadyAgreed(e) from e
    if any(g != gathered[0] for g in gathered):
        shown = "; ".join(f"rank {r}: {dict(g)}" for r, g in enumerate(gathered))
        raise AlreadyAgreed(CheckpointingError(
            f"checkpoint {unused.path}: the ranks' load_state_dict hooks moved different stored weights onto the "
            f"module's keys ({shown}): every rank must rename alike; nothing was read"))
    if not moved:
        return
    templates = unused.templates[entry]
    loaded = unused.read(entry, {name: _into_fresh(templates[name], key) for name, key in moved})
    with torch.no_grad():
        for name, (_, own) in found.moved.items():
            own.copy_(loaded[name])


def _into_fresh(st: ShardedTensor, key: str) -> ShardedTensor:
    """The module's ShardedTensor ``st`` read from the stored ``key`` into a tensor of its own (copied into the
    module's tensor then, as stock copies)."""
    return replace(st, key=key, data=None if st.data is None else torch.empty_like(st.data))


@contextlib.contextmanager
def refusing_placeholders(module: Module, unused: Optional[UnusedWeights], entry: str, strict: bool) -> Iterator[None]:
    """Around ``module.load_state_dict`` (stock's own call, after ``on_load_checkpoint``): the placeholders the
    user's pre-hooks (on the module or a submodule) moved onto its keys are read (:func:`_stand_in`,
    :func:`_read_moved`); those it finds unexpected are taken off its list and, where ``strict``, refused in the
    read's words once it returned (left unused, logged, where not); what else it finds is its own (torch's
    error, as stock: with keys missing too, the placeholders stay on its list, as stock names both sides). The
    module's keys the checkpoint lacks (:func:`hold_absent`) that no hook filled are refused with them where
    ``strict``; else named once, with the unused weights, in one warning in the caller's words (a key a hook
    filled is named nowhere: stock says nothing of either)."""
    names, held = (unused.names.get(entry), unused.held.get(entry)) if unused is not None else (None, None)
    if unused is None or not (names or (held and not strict)):  # strict: torch refuses a held-only entry's keys
        yield
        return
    names, held = names or {}, held or {}
    left: List[str] = []
    kept: Set[str] = set()  # held keys no hook filled (non-strict: they keep the module's own values)
    found = _Found()

    def read_moved(_: Module, __: Any) -> None:  # the root's post-hooks run once every module loaded
        _read_moved(module, unused, entry, strict, found)

    def take_placeholders(_: Module, incompatible: Any) -> None:
        # torch lets a post-hook edit the lists before its strict check
        left.extend(unused.refused(entry, incompatible.unexpected_keys))
        incompatible.unexpected_keys[:] = [k for k in incompatible.unexpected_keys if k not in names]
        absent = {held[k] for k in incompatible.missing_keys if k in held}
        if strict and absent:  # no hook filled them: refused in the read's words (both sides, close keys)
            check_keys(StrictHandling.ASSUME_OK_UNEXPECTED, unused.path, (), absent, absent, stored=sorted(left),
                       unasked=set(left))
        kept.update(absent)

    def stand_in(mod: Module, state_dict: Dict[str, Any], prefix: str, *_: Any) -> None:
        _stand_in(unused, entry, strict, found, mod, state_dict, prefix)

    handles = [mod.register_load_state_dict_pre_hook(stand_in) for mod in module.modules()] if names else []
    handles += [module.register_load_state_dict_post_hook(read_moved)] if names else []
    handles += [module.register_load_state_dict_post_hook(take_placeholders)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
    if strict:
        refuse_unused(unused.path, set(left))
    elif left or kept:
        _warn_lenient(unused, sorted(left), sorted(kept))


def _warn_lenient(unused: UnusedWeights, left: List[str], kept: List[str]) -> None:
    """A non-strict load's one warning once the module's hooks ran: the module's keys the checkpoint lacks that no
    hook filled (``kept``: they keep the module's own values) and the checkpoint's module weights left unused
    (``left``), each named once, in the caller's words (:attr:`UnusedWeights.lenient`)."""
    said = ([f"the module's keys {kept} are not in it and keep their own values"] if kept else []) + (
        [f"its module weights {left} are left unused"] if left else [])
    log.warning("checkpoint %s: %s (%s)", unused.path, "; ".join(said), unused.lenient)
