"""Checks around torch's own ``load_state_dict`` of an optimizer, for every restore (ours and torch's
state-dict API under the ModelParallel strategies).

A restore takes the hyper-parameters from the checkpoint (as torch's ``load_state_dict`` does), but the
state it read was what the template asked for: the state *this* optimizer's hyper-parameters keep. Where
the checkpoint's keep more (``momentum=0.9`` over an optimizer built with ``momentum=0``, ``amsgrad=True``
over ``amsgrad=False``) its buffers were never read: SGD went on with momentum 0.9 from an empty buffer
(silently not the saved run), Adam raised ``KeyError: 'max_exp_avg_sq'`` at the first step. A group
saved by another optimizer class (Adam's over SGD) lacks hyper-parameters the optimizer steps with
(``KeyError: 'momentum'`` at the first step). Both are refused at the restore, naming what differs.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, FrozenSet, List, Mapping, Optional

import torch

from ..core.errors import CheckpointingError

#: Group entries that are not hyper-parameters (torch keeps the optimizer's own on a load).
_NOT_HYPER = ("params", "param_names")
#: The hyper-parameters that decide which state torch's Adam / AdamW / SGD keep.
_STATE_HYPER = ("amsgrad", "momentum")


def unwrapped(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer itself under Lightning's and Fabric's wrappers (``LightningOptimizer``,
    ``_FabricOptimizer``: they hand attribute reads to it, but an assignment would stay on the wrapper)."""
    inner = getattr(optimizer, "_optimizer", None)
    return unwrapped(inner) if isinstance(inner, torch.optim.Optimizer) else optimizer


def state_names(optimizer: torch.optim.Optimizer, group: Mapping[str, Any]) -> Optional[FrozenSet[str]]:
    """The per-parameter state torch's ``Adam`` / ``AdamW`` / ``SGD`` (exactly these classes) keep under
    ``group``'s hyper-parameters; None for any other optimizer (its layout is not known)."""
    kind = type(optimizer)
    if kind in (torch.optim.Adam, torch.optim.AdamW):
        return frozenset({"step", "exp_avg", "exp_avg_sq", *(("max_exp_avg_sq",) if group.get("amsgrad") else ())})
    if kind is torch.optim.SGD:
        return frozenset({"momentum_buffer"} if group.get("momentum", 0) != 0 else ())
    return None


def load_checked(optimizer: torch.optim.Optimizer, load: Callable[[], None], where: str) -> None:
    """Run ``load`` (torch's ``load_state_dict`` of ``optimizer``, directly or through
    ``set_optimizer_state_dict``), then refuse the checkpoint's param groups where ``optimizer`` could not
    step with them (see the module docstring): a CheckpointingError naming ``where``, the optimizer's
    groups and state put back as they were before ``load``."""
    raw = unwrapped(optimizer)
    groups, state = raw.param_groups, raw.state
    asked = [state_names(raw, g) for g in groups]
    load()
    for g, (old, new, names) in enumerate(zip(groups, raw.param_groups, asked)):
        problem = _group_problem(raw, old, new, names)
        if problem is not None:
            raw.param_groups, raw.state = groups, state  # load_state_dict set new ones: the old are as they were
            raise CheckpointingError(f"{where}: the checkpoint's param group {g} {problem}")


def _group_problem(optimizer: torch.optim.Optimizer, old: Dict[str, Any], new: Dict[str, Any],
                   asked: Optional[FrozenSet[str]]) -> Optional[str]:
    """What keeps ``optimizer`` from stepping with the loaded group ``new`` (it was ``old``, whose
    state ``asked`` the template read), or None."""
    cls = type(optimizer).__name__
    # Only the class's own hyper-parameters (its defaults): a label of the user's (a group's "name") may come
    # and go between runs. torch's __setstate__ fills what newer versions added: what is still missing, the
    # class never had.
    lacking = _hyper([k for k in old if k not in new and k in optimizer.defaults])
    if lacking:
        return (f"has no {lacking}, which {cls} steps with (it has {_hyper([k for k in new if k not in old])} "
                f"instead): it was saved by another optimizer class; resume with the optimizer that saved it")
    now = state_names(optimizer, new) if asked is not None else None
    unread = sorted(now - asked) if now is not None and asked is not None else []
    if not unread:
        return None
    saved = {k: new.get(k) for k in _STATE_HYPER if old.get(k) != new.get(k)}
    built = {k: old.get(k) for k in saved}
    return (f"has {saved}, which keeps state {unread} that this {cls} (built with {built}) did not read from it; "
            f"build the optimizer with the checkpoint's hyper-parameters ({saved}) to resume it")


def _hyper(keys: List[str]) -> List[str]:
    return sorted(str(k) for k in keys if k not in _NOT_HYPER)
