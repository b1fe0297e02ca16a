"""Loading checkpoints laid out by tree path into a sharded template: a stock Lightning / Fabric
``torch.save`` file, or a directory ``DistCheckpointIO`` wrote under a rank-0-only strategy.

Both name each tensor by its ``/``-joined path in the saved dict: a Trainer checkpoint's weights are
``state_dict/<param>`` and its Adam moments ``optimizer_states/<i>/state/<param index>/exp_avg``;
``fabric.save(path, {"model": m, "optimizer": o})`` gives ``model/<param>`` and
``optimizer/state/<param index>/exp_avg``. The strategies' templates key the same tensors by the
module's sharded keys (``fc1.weight``, ``optimizer_states.0.state.exp_avg.fc1.weight``). Here the
template's ShardedTensors are re-keyed to the stored names (their data, the parameters and the
optimizer state themselves, stays), so every rank reads only its slices, and the result is put
back in the shape the strategies restore from. A tensor nested in a module's non-tensor value (extra
state ``{"n": 3, "t": tensor}``, stored as ``state_dict/sub._extra_state/t``) is read whole into its place
there, as stock hands it to ``set_extra_state``. Every other stored tensor (a callback's score, a
Fabric entry's tensors) is read whole into its place in the common state.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Dict, FrozenSet, List, Mapping, Optional, Sequence, Set, Tuple, Union

import torch
from torch.nn.modules.module import _EXTRA_STATE_KEY_SUFFIX

from ..core.errors import CheckpointingError, FormatError
from ..core.mapping import LocalNonpersistentObject, ShardedTensor
from ..optim.sharded_optimizer import NO_STATE, TEMPLATE_STATE, stored_param_groups
from ..core.state_dict import iter_leaves, map_leaves, merge
from ..planning.metadata import dtype_from_name
from ..reading.checkpoint import CheckpointSource
from ..reading.formats.detect import is_safetensors
from ..reading.formats.files import TorchFile
from ..reading.formats.tensor_files import IndexedFile, TensorFileSource
from ..reading.plain_tensors import MAX_PADDING
from ..serialization import load_common_state_dict
from ..storage.safe_pickle import load_file
from .key_order import common_first, key_orders, recorded_orders, restore_key_orders
from .tree import KIND_PLAIN, MANIFEST_KEY, TREE_TYPES, Step, iter_tensor_leaves, key_of, manifest_paths, place_at

if TYPE_CHECKING:  # checkpoint_io opens torch.save files with open_torch_file: imported for the types only
    from .restore_source import RestoreSource

#: A ``torch.save`` file's tensors: stored name -> typed path in the file's tree.
TreePaths = Dict[str, Tuple[Step, ...]]

#: Where the stored tensors outside the modules and optimizers travel in the template.
REST_KEY = "__stored_tensors__"


@dataclass(frozen=True)
class ModuleEntry:
    """A module's tensors: ``file_prefix + name`` in the file, ``key_prefix + name`` in the template."""

    file_prefix: str  # "state_dict/" (Trainer) or "model/" (Fabric)
    key_prefix: str  # "" (Trainer) or "model." (Fabric)


@dataclass(frozen=True)
class OptimizerEntry:
    """An optimizer's state: ``file_prefix/state/<index>/<name>`` in the file (``by_name``:
    ``file_prefix/state/<param key>/<name>``, as DistCheckpointModelParallelStrategy stores it); in the
    template, its ``optimizer_sharded_state_dict`` (``sharded``; parameters named by key, in the
    optimizer's order)."""

    file_prefix: str  # "optimizer_states/0" (Trainer) or "optimizer" (Fabric)
    sharded: Dict[str, Any]
    by_name: bool = False


@dataclass(frozen=True)
class SavedCheckpoint:
    """What a checkpoint's common state says about who wrote it."""

    kind: Optional[str]  # the manifest's kind (KIND_PLAIN / KIND_SHARDED); None: not ours
    manifest: Optional[Mapping[str, Any]]
    entries: FrozenSet[str]  # top-level entries of the saved dict (a file: those not made of tensors only)

    @property
    def by_trainer(self) -> bool:
        return bool({"state_dict", "loops"} & self.entries)


def describe_saved(path: str, extra_safe_globals: Sequence[Any] = ()) -> SavedCheckpoint:
    """Kind, manifest and top-level entries of the checkpoint at ``path`` (from its common state only)."""
    return describe_common(load_common_state_dict(path, extra_safe_globals))


def describe_common(common: Any) -> SavedCheckpoint:
    """Kind, manifest and top-level entries of a checkpoint, from its loaded common state."""
    if not isinstance(common, dict):
        return SavedCheckpoint(None, None, frozenset())
    man = common.get(MANIFEST_KEY)
    entries = {str(k) for k in common if k != MANIFEST_KEY}
    if not isinstance(man, Mapping):
        return SavedCheckpoint(None, None, frozenset(entries))
    entries |= {str(steps[0][1]) for steps, _ in man.get("tensor_paths", []) if steps}
    return SavedCheckpoint(man.get("kind"), man, frozenset(entries))


def is_tree_path_layout(path: str, kind: Any) -> bool:
    """A ``torch.save`` file, or one of our directories written by the plugin (kind ``plain``)."""
    return os.path.isfile(path) or kind == KIND_PLAIN


def _param_keys(sharded_optimizer: Mapping[str, Any]) -> List[str]:
    keys = sharded_optimizer["param_keys"]
    return list(keys.unwrap() if isinstance(keys, LocalNonpersistentObject) else keys)


def module_renames(module_ssd: Any, entry: ModuleEntry) -> Dict[str, str]:
    """template key -> stored name, for the module's ShardedTensors."""
    out = {}
    for _, leaf in iter_leaves(module_ssd):
        if isinstance(leaf, ShardedTensor) and leaf.key.startswith(entry.key_prefix):
            out[leaf.key] = entry.file_prefix + leaf.key[len(entry.key_prefix):]
    return out


def optimizer_renames(entry: OptimizerEntry, stored: Set[str]) -> Dict[str, str]:
    """template key -> stored name, for the optimizer's per-parameter state. A stored scalar state
    (Adam's ``step`` in a ``torch.save`` file) becomes a whole ShardedTensor of the template, read
    into the optimizer's own scalar; the plugin keeps scalars in the common state instead.

    torch keeps no state for a parameter that never had a gradient (a checkpoint saved before the
    first step, a frozen parameter): where none is stored for a parameter, its template state is not
    asked of the checkpoint (a strict load refused such a stock checkpoint, which stock Fabric loads),
    and the parameter is listed under :data:`NO_STATE`, so the restore leaves it without state as
    ``optimizer.load_state_dict`` of the stored dict does (a first step from zeros is not a first step
    from nothing for SGD with dampening, NAdam, Rprop, ASGD)."""
    out = {}
    state = entry.sharded.get("state", {})
    stored_params = {k.rsplit("/", 1)[0] for k in stored if k.startswith(f"{entry.file_prefix}/state/")}
    without: List[str] = []
    for j, pkey in enumerate(_param_keys(entry.sharded)):
        param_prefix = f"{entry.file_prefix}/state/{pkey if entry.by_name else j}"
        if state.get(pkey) and param_prefix not in stored_params:
            without.append(pkey)
        for name, value in state.get(pkey, {}).items():
            file_key = f"{param_prefix}/{name}"
            if param_prefix not in stored_params:
                fresh = value.data if isinstance(value, ShardedTensor) else value
                state[pkey][name] = LocalNonpersistentObject(fresh)  # load puts it back as it is
            elif isinstance(value, ShardedTensor):
                out[value.key] = file_key
            elif isinstance(value, torch.Tensor) and file_key in stored:
                state[pkey][name] = ShardedTensor.from_rank_offsets(file_key, value)
    if without:  # what the checkpoint says, not a common value looked for in it
        entry.sharded[NO_STATE] = LocalNonpersistentObject(tuple(without))
    return out


def with_nested_tensors(module_ssd: Dict[str, Any], entry: ModuleEntry, stored: Mapping[str, ShardedTensor],
                        paths: TreePaths, where: str = "the checkpoint") -> Dict[str, Any]:
    """``module_ssd`` asking for each stored tensor nested in one of its non-tensor values (a module's extra state
    ``{"n": 3, "t": tensor}`` is stored as ``state_dict/sub._extra_state/t``): a whole ShardedTensor of the stored
    shape and dtype, keyed by its stored name, at its place in a copy of that value. Stock hands
    ``set_extra_state`` the stored value; the template's own (the module's current one, a common leaf) would
    otherwise come back in its place and the stored one go unread. The stored value's shape wins over the
    module's fresh one: a dict key or list position the fresh value lacks (a key added after the first step, a
    per-step list that grew) is created, a fresh leaf where the stored value has a container is replaced (the
    common state fills in the stored non-tensor parts). Only values the module's state dict has that are
    containers, or a module's extra state of any kind but a ShardedTensor, are asked for: any other stored
    tensor is left as before (unread, refused by a strict load). The module's own containers are not changed.
    Raises FormatError naming ``where`` for list positions needing more than MAX_PADDING empty slots."""
    top = ("d", entry.file_prefix[:-1])
    out = dict(module_ssd)
    copied: Set[int] = set()  # the containers copied or made so far (two tensors in one extra state: copied once)
    padded = 0
    for key, steps in paths.items():
        if key not in stored or len(steps) < 3 or tuple(steps[0]) != top or steps[1][0] != "d":
            continue
        name = steps[1][1]
        own = out.get(name, None)
        extra = isinstance(name, str) and name.endswith(_EXTRA_STATE_KEY_SUFFIX) and name in out
        if not isinstance(own, (dict, list)) and not (extra and not isinstance(own, ShardedTensor)):
            continue  # a module tensor, or nothing of the module's there
        meta = stored[key]
        whole = ShardedTensor.from_rank_offsets(key, torch.empty(meta.global_shape, dtype=meta.dtype))
        padded += _put_grown(out, steps[1:], whole, copied, MAX_PADDING - padded)
        if padded > MAX_PADDING:  # a manifest's path (not a real list's) may name any position: refused unmade
            raise FormatError(f"checkpoint {where}: stored extra state puts tensors at list positions needing more "
                              f"than {MAX_PADDING} empty slots before them (at {key!r}); not a list a module saved")
    return out


def _put_grown(root: Dict[str, Any], steps: Tuple[Step, ...], leaf: Any, copied: Set[int], room: int) -> int:
    """Put ``leaf`` at ``steps`` under ``root``, copying each container on the way that is not a copy yet, and
    making the dicts, lists and list slots (None) the way lacks; a fresh leaf on the way is replaced by the
    stored kind of container. Returns the list slots padded; past ``room`` slots, nothing more is made and more
    than ``room`` is returned (the caller refuses). Nothing is put where the way leads through a tuple (stock's
    tuples are common values as a whole) or a ShardedTensor (a tensor the template reads itself)."""
    if any(kind not in ("d", "l") or (kind == "l" and not (isinstance(k, int) and k >= 0)) for kind, k in steps):
        return 0
    node: Any = root
    padded = 0
    for i, (kind, k) in enumerate(steps):
        if kind == "l" and k >= len(node):
            padded += k + 1 - len(node)
            if padded > room:  # checked before the list is made: a crafted position takes no memory
                return padded
            node.extend([None] * (k + 1 - len(node)))
        if i == len(steps) - 1:
            node[k] = leaf
            return padded
        child = node.get(k) if kind == "d" else node[k]
        want = dict if steps[i + 1][0] == "d" else list
        if isinstance(child, ShardedTensor):
            return padded
        if not isinstance(child, want) or id(child) not in copied:
            child = want(child) if isinstance(child, want) else want()
            copied.add(id(child))
            node[k] = child
        node = child
    return padded


@dataclass
class StoredLayout:
    """The template :func:`rekey_template` made, and where each stored tensor read whole goes."""

    template: Dict[str, Any]
    rest_paths: Dict[str, Tuple[Step, ...]]  # stored name -> its typed path in the saved dict
    # template entry of an optimizer -> where its stored param groups sit in the loaded tree, when
    # not in the entry itself (a Trainer's optimizer_states/<i> read into a Fabric state's optimizer)
    optimizer_sources: Dict[str, Tuple[Union[str, int], ...]] = field(default_factory=dict)
    # template entry of a module -> the saved dict's entry its state dict was read from, when another (a Trainer's
    # state_dict read into a Fabric state's module): its common values (extra state's non-tensor parts) go there too
    module_sources: Dict[str, str] = field(default_factory=dict)
    # the saved key order of the dicts placing the tensors back would change (key_order.py), restored after
    key_orders: List[List[Any]] = field(default_factory=list)

    def stored_optimizer(self, loaded: Mapping[str, Any], name: str) -> Dict[str, Any]:
        """The optimizer entry ``name`` of ``loaded``, with the stored param groups and by-index state."""
        read = dict(loaded[name])
        path = self.optimizer_sources.get(name)
        if path is None:
            return read
        node: Any = loaded
        for step in path:
            ok = (isinstance(node, list) and isinstance(step, int) and step < len(node)) or \
                (isinstance(node, Mapping) and step in node)
            node = node[step] if ok else {}
        if not isinstance(node, Mapping):
            return read
        return {**read, **{k: v for k, v in node.items() if k != "state"},
                "state": {**node.get("state", {}), **read.get("state", {})}}


def tensors_metadata(source: CheckpointSource) -> Dict[str, ShardedTensor]:
    """key -> ShardedTensor without data describing each whole stored tensor (as
    :func:`lightning_distckpt.load_tensors_metadata`, from a source already open)."""
    out = {}
    for key, e in source.index.tensors.items():
        shape = tuple(e.global_shape)
        out[key] = ShardedTensor(key=key, data=None, dtype=dtype_from_name(e.dtype, key), local_shape=shape,
                                 global_shape=shape, global_offset=(0,) * len(shape),
                                 axis_fragmentations=(1,) * len(shape))
    return out


def open_torch_file(path: str, extra_safe_globals: Sequence[Any] = ()
                    ) -> Optional[Tuple[CheckpointSource, TreePaths, List[List[Any]]]]:
    """A ``torch.save`` file opened for a restore, unpickled once: the source
    :func:`~lightning_distckpt.reading.checkpoint.open_checkpoint` gives for it (same checks, same
    errors), the typed path of each tensor in the file's tree (where :func:`rekey_template`
    puts back the tensors read whole), and its dicts' key orders that putting them back would change.
    None for anything else (a directory, a ``.safetensors`` file)."""
    if not os.path.isfile(path) or is_safetensors(path):
        return None
    payload = load_file(path, extra_safe_globals)
    # a tuple is common state whole, tensors and all (as the strategies save it): its tensors have no tree path
    file = TorchFile.from_payload(path, payload, TREE_TYPES)
    source = TensorFileSource(path, [IndexedFile(file, None)], common=file.common)
    paths = {key_of(steps): steps for steps, _ in iter_tensor_leaves(payload)}  # the bounded walk key_orders needs
    return source, paths, key_orders(payload, lambda steps, tensor: True)  # every one is named (a tuple's aside)


def _stored_paths(source: "RestoreSource", extra_safe_globals: Sequence[Any]) -> TreePaths:
    """Every stored tensor's typed path: a ``torch.save`` file's own tree (taken when it was opened),
    or the manifest of a plugin directory (its common state, read once per restore)."""
    if source.tree_paths is not None:
        return source.tree_paths
    if os.path.isfile(source.path):  # another file (.safetensors): refused as no torch.save archive, as before
        return {key_of(steps): steps for steps, _ in iter_tensor_leaves(load_file(source.path, extra_safe_globals))}
    man = _manifest(source, extra_safe_globals)
    return manifest_paths(man, source.path) if man is not None else {}


def _manifest(source: "RestoreSource", extra_safe_globals: Sequence[Any]) -> Any:
    common = source.load_common(extra_safe_globals)
    return common.get(MANIFEST_KEY) if isinstance(common, dict) else None


def _stored_orders(source: "RestoreSource", extra_safe_globals: Sequence[Any]) -> List[List[Any]]:
    """The saved key orders: a ``torch.save`` file's own (taken when it was opened), or a directory's manifest's."""
    own = getattr(source, "key_orders", None)
    if own is not None or os.path.isfile(source.path):
        return own or []
    return recorded_orders(_manifest(source, extra_safe_globals))


def rekey_template(source: "RestoreSource", template: Dict[str, Any], modules: Mapping[str, ModuleEntry],
                   optimizers: Sequence[OptimizerEntry], skip_prefixes: Sequence[str],
                   extra_safe_globals: Sequence[Any] = ()) -> StoredLayout:
    """``template`` with each ShardedTensor keyed by its stored name, plus every stored tensor outside
    ``skip_prefixes`` whole under :data:`REST_KEY`. ``modules`` maps template entries to their layout.
    ``source``: the checkpoint the restore opened (:meth:`DistCheckpointIO.open_source`), not opened again."""
    stored = tensors_metadata(source)
    stored_paths = _stored_paths(source, extra_safe_globals)
    renames: Dict[str, str] = {}
    for name, entry in modules.items():
        renames.update(module_renames(template[name], entry))
        template[name] = with_nested_tensors(template[name], entry, stored, stored_paths, source.path)
    for opt in optimizers:
        renames.update(optimizer_renames(opt, set(stored)))

    def rekey(leaf: Any) -> Any:
        if isinstance(leaf, ShardedTensor) and leaf.key in renames:
            return replace(leaf, key=renames[leaf.key])
        return leaf

    out = map_leaves(rekey, template)
    paths = {key: steps for key, steps in stored_paths.items()
             if key in stored and not any(key.startswith(p) for p in skip_prefixes)}
    out[REST_KEY] = {key: ShardedTensor.from_rank_offsets(
        key, torch.empty(stored[key].global_shape, dtype=stored[key].dtype)) for key in paths}
    return StoredLayout(out, paths, key_orders=_stored_orders(source, extra_safe_globals))


def place_stored_tensors(loaded: Dict[str, Any], layout: StoredLayout, where: str) -> Dict[str, Any]:
    """Put the tensors read under :data:`REST_KEY` back at their paths in ``loaded`` (drops the manifest)."""
    loaded.pop(MANIFEST_KEY, None)
    place_at(loaded, layout.rest_paths, loaded.pop(REST_KEY, {}), where)
    for name, saved in layout.module_sources.items():
        stored, own = loaded.get(saved), layout.template.get(name)
        if not (isinstance(stored, dict) and isinstance(own, dict)):
            continue
        entry = loaded.setdefault(name, {})
        for key, value in stored.items():  # the module's own names only: the rest stays where it was saved
            if key in own and isinstance(entry, dict):
                # the stored values win over the template's (a non-strict load's fallback), as the common
                # state wins for a module read from its own entry; the tensors read into the entry stay
                entry[key] = merge(entry[key], copy.deepcopy(value)) if key in entry else copy.deepcopy(value)
                common_first(entry[key], value)  # as a merge into the common state orders it (restored below)
    # a module read from another entry (a Trainer's state_dict into a Fabric module) keeps its saved order there too
    moved = [[[["d", name]] + steps[1:], keys] for name, saved in layout.module_sources.items()
             for steps, keys in (o for o in layout.key_orders if isinstance(o, list) and len(o) == 2)
             if isinstance(steps, list) and steps[:1] == [["d", saved]]]
    restore_key_orders(loaded, layout.key_orders + moved, where)
    return loaded


def restore_param_keys(opt_state: Mapping[str, Any], param_keys: Sequence[str], where: str) -> Dict[str, Any]:
    """A stored ``torch.optim`` state dict (state and param groups by parameter index), merged with
    what the template read, in the layout ``restore_optimizer_state`` takes (by parameter key)."""
    keys = list(param_keys)
    groups = stored_param_groups(opt_state.get("param_groups", []), f"checkpoint {where}")
    n_stored = sum(len(g.get("params", [])) for g in groups)
    if n_stored != len(keys):
        raise CheckpointingError(
            f"checkpoint {where}: the stored optimizer has {n_stored} parameters, this optimizer {len(keys)}; "
            "resume with the same model and optimizer parameter groups that saved it")
    state = opt_state.get("state", {})
    by_key: Dict[str, Dict[str, Any]] = {}
    for j, pkey in enumerate(keys):
        entry: Dict[str, Any] = {}
        # What was read into the template (by key) first; what the checkpoint stored by index wins
        # (the plugin keeps Adam's scalar step in the common state, a non-strict template a fresh one).
        for k in (pkey, j, str(j)):
            if isinstance(state.get(k), Mapping):
                entry.update(state[k])
        if entry:
            by_key[pkey] = entry
    # Stored groups name parameters by index; a non-strict load's fallback groups name them by key.
    bad = [p for g in groups for p in g.get("params", []) if isinstance(p, int) and not 0 <= p < len(keys)]
    if bad:  # keys[p] would raise IndexError, or name another parameter for a negative p
        raise CheckpointingError(f"checkpoint {where}: the stored optimizer's param_groups name parameter index "
                                 f"{bad[0]!r}, outside 0..{len(keys) - 1}")
    new_groups = [{**g, "params": [keys[p] if isinstance(p, int) else p for p in g.get("params", [])]} for g in groups]
    out = {"state": by_key, "param_groups": new_groups, "param_keys": keys}
    for name in (TEMPLATE_STATE, NO_STATE):  # the template's own state for restore_optimizer_state's checks,
        if name in opt_state:               # and the parameters saved without state
            out[name] = opt_state[name]
    return out

