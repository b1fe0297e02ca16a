"""A ``torch.optim`` optimizer's state as a sharded state dict, derived from the model's.

Per-parameter state tensors of the parameter's shape (Adam's ``exp_avg`` / ``exp_avg_sq``, SGD's
``momentum_buffer``, ...) are sharded exactly like their parameter: same global shape, offset,
replica id, factory. Everything else the optimizer keeps (scalar state such as Adam's 0-d
``step``, and ``param_groups``) is common state. Parameters are named by their model key, not
by their position in the optimizer, so a checkpoint loads under any split of the model.

Layout of the returned dict (``prefix="optimizer"``)::

    {"state": {param_key: {"exp_avg": ShardedTensor("optimizer.state.exp_avg.<param_key>"),
                           "step": tensor(3.)}},            # scalar: common state
     "param_groups": [{"lr": ..., "params": [param_key, ...]}],
     "param_keys": LocalNonpersistentObject([...]),       # this rank's parameter order
     "template_state": LocalNonpersistentObject({...}),   # the state the template holds, by key
     "no_state": (param_key, ...)}                        # those the optimizer had no state for (if any)

State the template needs but the optimizer did not have (before a parameter's first gradient) is made
for the template and taken out of the optimizer again: a save leaves training as it was, and a restore
leaves those parameters without state, as torch had them (``no_state``).
"""

from __future__ import annotations

import functools
from dataclasses import replace
from collections.abc import Mapping
from typing import Any, Dict, FrozenSet, List, Optional, Union

import torch

from ..core.errors import CheckpointingError
from ..core.mapping import LocalNonpersistentObject, ShardedTensor, ShardedTensorFactory
from ..core.state_dict import iter_leaves
from .restore_checks import load_checked

ParamEntry = Union[ShardedTensor, ShardedTensorFactory]
#: Saved: the parameters the saving optimizer kept no state for (their stored state is a placeholder).
NO_STATE = "no_state"
#: Not saved: each parameter's state as the template's optimizer keeps it (what a restore must find).
TEMPLATE_STATE = "template_state"
_PLAIN = (int, float, bool, str, type(None))


def _params(optimizer: torch.optim.Optimizer) -> List[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the lazily initialised state of every parameter that has none, without changing
    any parameter.

    For ``torch.optim.Adam``, ``AdamW`` and ``SGD`` (exactly these classes) the state their first
    step would create is built directly, zeroed (:func:`fresh_state`): no step is run, nothing is
    computed over the parameters. Any other optimizer runs one ``optimizer.step()`` with zero
    gradients on those parameters only (the others get no gradient for it, so optimizers skip
    them), puts the parameters and gradients back, and zeroes the new state. For optimizers whose
    fresh state is all zeros (Adam, AdamW, SGD with momentum and ``dampening=0``, RMSprop, Adamax,
    RAdam, Adadelta, ...) this is exactly the state their first step would create; for others it is
    a placeholder that ``load`` overwrites. Optimizers that need a closure get one returning a zero
    loss.
    """
    fresh = [(group, p) for group in optimizer.param_groups for p in group["params"] if not optimizer.state.get(p)]
    if not fresh:
        return
    if type(optimizer) in _KNOWN_LAYOUTS:
        for group, p in fresh:
            state = fresh_state(optimizer, group, p)
            if state:
                optimizer.state[p] = state
        return
    _init_state_by_step(optimizer, [p for _, p in fresh])


def _scalar_dtype(fused: bool) -> torch.dtype:
    """The dtype of a fresh ``step`` tensor (as ``torch.optim.optimizer._get_scalar_dtype``)."""
    if fused:
        return torch.float32
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def _zeros(p: torch.Tensor) -> torch.Tensor:
    """Zeros like ``p`` (shape, dtype, device, strides), from torch's allocator as the first step's are: the
    state is the user's optimizer's, kept for the rest of training, so it must behave as torch's own (a
    ``calloc``'d numpy buffer, ``torch.from_numpy``, made its storage not resizable for good: ``resize_``
    raised "Trying to resize storage that is not resizable")."""
    return torch.zeros_like(p, memory_format=torch.preserve_format)


def fresh_state(optimizer: torch.optim.Optimizer, group: Dict[str, Any], p: torch.Tensor) -> Optional[Dict[str, Any]]:
    """The state the first step of ``torch.optim.Adam`` / ``AdamW`` / ``SGD`` creates for ``p`` in
    ``group``, zeroed (``step`` 0, moments and momentum buffer zeros of the parameter's shape, dtype,
    device and layout); an empty dict where that step creates none (SGD without momentum); None for
    any other optimizer class, whose layout is not known."""
    kind = type(optimizer)
    if kind in (torch.optim.Adam, torch.optim.AdamW):
        fused = bool(group.get("fused"))
        step = (torch.zeros((), dtype=_scalar_dtype(fused), device=p.device) if group.get("capturable") or fused
                else torch.tensor(0.0, dtype=_scalar_dtype(False), device="cpu"))
        state: Dict[str, Any] = {"step": step, "exp_avg": _zeros(p), "exp_avg_sq": _zeros(p)}
        if group.get("amsgrad"):
            state["max_exp_avg_sq"] = _zeros(p)
        return state
    if kind is torch.optim.SGD:
        return {"momentum_buffer": _zeros(p)} if group.get("momentum", 0) != 0 else {}
    return None


#: Optimizer classes whose fresh state :func:`fresh_state` builds without a step.
_KNOWN_LAYOUTS = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)


def _init_state_by_step(optimizer: torch.optim.Optimizer, fresh: List[torch.Tensor]) -> None:
    """The general way: one step on zero gradients of ``fresh`` (see :func:`init_optimizer_state`)."""
    params = _params(optimizer)
    fresh_ids = {id(p) for p in fresh}
    grads = [p.grad for p in params]
    kept = [p.detach().clone() for p in fresh]
    try:
        for p in params:
            p.grad = torch.zeros_like(p) if id(p) in fresh_ids else None
        try:
            optimizer.step(lambda: torch.zeros(()))
        except Exception as e:
            raise CheckpointingError(
                f"cannot initialise the state of {type(optimizer).__name__} (one step on zero gradients failed: "
                f"{type(e).__name__}: {e}); take one real step before building its sharded state dict"
            ) from e
    finally:
        with torch.no_grad():
            for p, saved in zip(fresh, kept):
                p.copy_(saved)
        for p, g in zip(params, grads):
            p.grad = g
    with torch.no_grad():
        for p in fresh:
            for value in optimizer.state.get(p, {}).values():
                if isinstance(value, torch.Tensor):
                    value.zero_()


def _param_entries(model_sharded_state_dict: Any) -> Dict[int, ParamEntry]:
    """id(parameter) -> the first ShardedTensor / factory whose ``data`` is that parameter."""
    out: Dict[int, ParamEntry] = {}
    for _, leaf in iter_leaves(model_sharded_state_dict):
        if isinstance(leaf, (ShardedTensor, ShardedTensorFactory)) and leaf.data is not None:
            out.setdefault(id(leaf.data), leaf)
    return out


def _state_entry(optimizer: torch.optim.Optimizer, name: str, value: Any, param: torch.Tensor,
                 entry: ParamEntry, prefix: str) -> Any:
    """A ShardedTensor / factory for per-parameter state, the value itself for scalar state."""
    cls = type(optimizer).__name__
    if isinstance(value, torch.Tensor):
        if value.dim() == 0 and param.dim() != 0:
            return value  # scalar state (Adam's step): common
        if tuple(value.shape) == tuple(param.shape):
            key = f"{prefix}.state.{name}.{entry.key}"
            if isinstance(entry, ShardedTensorFactory):
                return _factory_for_state(entry, key, value)
            return replace(entry, key=key, data=value, dtype=value.dtype)
        raise CheckpointingError(
            f"cannot map state {name!r} of optimizer {cls} for parameter {entry.key!r}: it is a tensor of shape "
            f"{tuple(value.shape)} but the parameter has shape {tuple(param.shape)}; only state of the parameter's "
            f"shape (sharded like the parameter) and scalar state (common) can be checkpointed"
        )
    if isinstance(value, _PLAIN):
        return value
    raise CheckpointingError(
        f"cannot map state {name!r} of optimizer {cls} for parameter {entry.key!r}: values of type "
        f"{type(value).__name__} are neither a tensor of the parameter's shape nor a scalar"
    )


def _factory_for_state(entry: ShardedTensorFactory, key: str, value: torch.Tensor) -> ShardedTensorFactory:
    """The parameter's factory applied to its state ``value`` under ``key``. A merge bound to the
    parameter (a DTensor's or a plain tensor's factory, ``partial(restore, param)``: it puts the loaded
    values into the tensor it was made for) is bound to the state instead: kept, it wrote the loaded
    ``exp_avg`` into the parameter and handed back the parameter as the optimizer's ``exp_avg``."""
    merge = entry.merge_fn
    if isinstance(merge, functools.partial) and merge.args and merge.args[0] is entry.data:
        bound = functools.partial(merge.func, value, *merge.args[1:], **merge.keywords)
        # A plain ShardedTensorFactory: a subclass's own fields (a plain tensor's tree place) are the parameter's.
        return ShardedTensorFactory(key=key, data=value, build_fn=entry.build_fn, merge_fn=bound,
                                    replica_id=entry.replica_id, flattened_range=entry.flattened_range)
    return replace(entry, key=key, data=value)


def optimizer_sharded_state_dict(
    optimizer: torch.optim.Optimizer,
    model_sharded_state_dict: Dict[str, Any],
    *,
    prefix: str = "optimizer",
    init_state: bool = True,
) -> Dict[str, Any]:
    """The optimizer's sharded state dict, sharded like the model.

    Args:
        optimizer: a ``torch.optim`` optimizer over (some of) the model's parameters.
        model_sharded_state_dict: the model's sharded state dict whose ShardedTensors (or
            ShardedTensorFactories) have the parameters themselves as ``data`` (build it from
            ``module.state_dict(keep_vars=True)``); parameters are matched by identity.
        prefix: first component of the state keys: ``<prefix>.state.<state name>.<param key>``.
        init_state: create missing state (see :func:`init_optimizer_state`) so that a template for
            ``load`` exists before the first step; it is held by the returned dict only, not left in
            ``optimizer`` (the parameters are listed under ``"no_state"``).

    Each per-parameter state tensor of the parameter's shape becomes a ShardedTensor with the
    parameter's sharding and replica id (or the parameter's factory, applied to the state);
    scalar state and ``param_groups`` are common state.

    Raises:
        CheckpointingError: a parameter is not in the model's sharded state dict, or a state
            cannot be mapped (naming the optimizer class and the state).
    """
    stateless = {id(p): p for p in _params(optimizer) if not optimizer.state.get(p)} if init_state else {}
    if init_state:
        init_optimizer_state(optimizer)
    entries = _param_entries(model_sharded_state_dict)
    cls = type(optimizer).__name__
    state: Dict[str, Dict[str, Any]] = {}
    groups: List[Dict[str, Any]] = []
    param_keys: List[str] = []
    held: Dict[str, Dict[str, Any]] = {}  # each parameter's state as this optimizer keeps it (the template's)
    made: List[str] = []  # parameters whose state init_state made (placeholders: they had none)
    seen: Dict[str, int] = {}
    for g, group in enumerate(optimizer.param_groups):
        keys = []
        for p in group["params"]:
            entry = entries.get(id(p))
            i = len(param_keys)
            if entry is None:
                raise CheckpointingError(
                    f"optimizer {cls}: parameter #{i} (param group {g}, shape {tuple(p.shape)}, dtype {p.dtype}) "
                    "is not "
                    f"the data of any ShardedTensor or ShardedTensorFactory of the model's sharded state dict "
                    f"(build it from module.state_dict(keep_vars=True) so the parameters themselves are its data)"
                )
            if entry.key in seen:
                raise CheckpointingError(
                    f"optimizer {cls}: parameters #{seen[entry.key]} and #{i} both map to model key {entry.key!r}"
                )
            seen[entry.key] = i
            keys.append(entry.key)
            param_keys.append(entry.key)
            pstate = optimizer.state.get(p)
            if pstate:
                state[entry.key] = {name: _state_entry(optimizer, name, v, p, entry, prefix)
                                    for name, v in pstate.items()}
                held[entry.key] = dict(pstate)
                if id(p) in stateless:
                    made.append(entry.key)
        groups.append({**{k: v for k, v in group.items() if k not in ("params", "param_names")}, "params": keys})
    # The state init_state made is a placeholder (for the template of a load): out of the optimizer again,
    # so that building a save's state dict leaves training as it was (torch keeps no state for a parameter
    # before its first gradient; the first step from zeros is not the first step from none for NAdam, Rprop,
    # ASGD, SGD with dampening). The tree holds it; the checkpoint says which it is (NO_STATE).
    for p in stateless.values():
        optimizer.state.pop(p, None)
    # A tuple: a common value as a whole, which a non-strict load of a checkpoint without one fills in from
    # this template (the Lightning plugin's fallback) as this very object, told apart by the restore.
    no_state = tuple(made) if made else None
    out = {"state": state, "param_groups": groups, "param_keys": LocalNonpersistentObject(param_keys),
           TEMPLATE_STATE: LocalNonpersistentObject({"state": held, NO_STATE: no_state})}
    if no_state:
        out[NO_STATE] = no_state
    return out


def restore_optimizer_state(optimizer: torch.optim.Optimizer, loaded_optimizer_state: Dict[str, Any]) -> None:
    """Put ``loaded_optimizer_state``, what ``load`` returned for an :func:`optimizer_sharded_state_dict`
    template, back into ``optimizer`` (via ``optimizer.load_state_dict``).

    Hyperparameters come from the checkpoint's ``param_groups``; per-parameter state is matched
    to this optimizer's parameters by model key.

    Raises:
        CheckpointingError: the number of param groups differs, a parameter sits in another
            group than in the checkpoint, or a state this optimizer keeps is missing.
    """
    cls = type(optimizer).__name__
    try:
        keys = loaded_optimizer_state["param_keys"]
        saved_groups = loaded_optimizer_state["param_groups"]
        saved_state = loaded_optimizer_state.get("state", {})
    except (KeyError, TypeError) as e:
        raise CheckpointingError(
            f"optimizer {cls}: restore_optimizer_state needs what load() returned for an "
            f"optimizer_sharded_state_dict template (missing {e})"
        ) from None
    if isinstance(keys, LocalNonpersistentObject):
        keys = keys.unwrap()
    template = loaded_optimizer_state.get(TEMPLATE_STATE)
    if isinstance(template, LocalNonpersistentObject):
        template = template.unwrap()
    held = template.get("state") if isinstance(template, Mapping) else None
    stored = loaded_optimizer_state.get(NO_STATE)
    if stored is not None and isinstance(template, Mapping) and stored is template.get(NO_STATE):
        stored = None  # the template's own, filled in for a checkpoint that has none: not what was saved
    no_state = _no_state(stored, f"optimizer {cls}")
    params = _params(optimizer)
    if len(keys) != len(params):
        raise CheckpointingError(
            f"optimizer {cls}: the loaded template names {len(keys)} parameters but the optimizer has {len(params)}"
        )
    saved_groups = stored_param_groups(saved_groups, f"optimizer {cls}")
    if len(saved_groups) != len(optimizer.param_groups):
        raise CheckpointingError(
            f"optimizer {cls}: the checkpoint has {len(saved_groups)} param groups, the optimizer "
            f"{len(optimizer.param_groups)}"
        )
    saved_group_of = {k: g for g, sg in enumerate(saved_groups) for k in sg.get("params", [])}
    torch_state: Dict[int, Dict[str, Any]] = {}
    torch_groups: List[Dict[str, Any]] = []
    i = 0
    for g, (group, saved) in enumerate(zip(optimizer.param_groups, saved_groups)):
        ids = []
        for p in group["params"]:
            key = keys[i]
            if saved_group_of.get(key, g) != g:
                raise CheckpointingError(
                    f"optimizer {cls}: parameter {key!r} is in param group {g} but in group {saved_group_of[key]} "
                    f"in the checkpoint"
                )
            loaded = saved_state.get(key)
            if key in no_state:  # the saving optimizer had no state for it: neither has this one
                ids.append(i)
                i += 1
                continue
            current = (held.get(key) if isinstance(held, Mapping) else optimizer.state.get(p)) or {}
            lacking = sorted(set(current) - set(loaded or {}))
            if lacking:
                raise CheckpointingError(
                    f"optimizer {cls}: state {lacking} of parameter {key!r} is not in the checkpoint"
                )
            if loaded:
                _check_loaded_state(cls, key, current, loaded)
                torch_state[i] = dict(loaded)
            ids.append(i)
            i += 1
        torch_groups.append({**{k: v for k, v in saved.items() if k not in ("params", "param_names")}, "params": ids})
    load_checked(optimizer, lambda: optimizer.load_state_dict({"state": torch_state, "param_groups": torch_groups}),
                 f"optimizer {cls}")


def _no_state(value: Any, where: str) -> FrozenSet[str]:
    """The stored :data:`NO_STATE` list (common state: untrusted), none where a checkpoint has none."""
    if value is None:
        return frozenset()
    if isinstance(value, (list, tuple)) and all(isinstance(k, str) for k in value):
        return frozenset(value)
    raise CheckpointingError(f"{where}: the stored {NO_STATE!r} is malformed ({type(value).__name__}): a list of "
                             "parameter keys expected")


def _check_loaded_state(cls: str, key: str, current: Mapping[str, Any], loaded: Mapping[str, Any]) -> None:
    """Each per-parameter state tensor this optimizer keeps (``exp_avg``: the template the load read
    into) came back a tensor of its shape. A factory's ``merge_fn`` may hand back anything; torch's
    ``load_state_dict`` takes it unchecked, and the first ``step()`` fails on that rank alone, inside
    training, while the other ranks wait for it in their next collective."""
    for name, now in current.items():
        value = loaded.get(name)
        if isinstance(now, torch.Tensor) and now.dim() > 0 and not (
                isinstance(value, torch.Tensor) and value.shape == now.shape):
            got = f"a tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__
            raise CheckpointingError(f"optimizer {cls}: state {name!r} of parameter {key!r} was loaded as {got}, "
                                     f"not a tensor of shape {tuple(now.shape)}")


def stored_param_groups(groups: Any, where: str) -> List[Mapping[str, Any]]:
    """A stored optimizer's ``param_groups`` (common state: untrusted) as a list: dicts, each ``params`` a
    list of indices or names; else a CheckpointingError naming ``where`` (not an AttributeError or
    TypeError from deep in a restore)."""
    if isinstance(groups, (list, tuple)) and all(
            isinstance(g, Mapping) and isinstance(g.get("params", []), (list, tuple))
            and all(isinstance(p, (int, str)) for p in g.get("params", [])) for g in groups):
        return list(groups)
    text = repr(groups)
    raise CheckpointingError(f"{where}: the stored optimizer's param_groups are malformed "
                             f"({text if len(text) <= 80 else text[:77] + '...'}): a list of dicts, each with a "
                             "list of parameter indices or names, expected")
