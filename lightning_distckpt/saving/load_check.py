"""A WARNING at save time for a type a load will refuse, rather than first at the resume.

A load never runs code (``storage/safe_pickle.py``): a class of the user's own in the common state or a
ShardedObject (a dataclass of hyperparameters, an ``argparse.Namespace``, a NumPy array) loads only when it
is allow-listed. ``torch.save`` writes such a state without a word, and the run finds out hours later, at
its first resume (stock Lightning alike, from torch's weights-only load). So rank 0 looks at the globals
its pickles name (protocol 2's ``GLOBAL`` opcode spells each ``module\\nname\\n`` in plain bytes) and,
where one is outside every allow-list, loads the pickle once the way a load will; a refusal is logged with
the load's own words, which say how to allow the type.

Cheap where nothing is unusual: a regex over the bytes and set lookups. A name the regex finds in a
string's bytes, or one torch allows by a rule of its own (storage types), costs one trial load per run
(remembered in :class:`LoadCheck`, which a :class:`~.save_prepare.SavePlanCache` keeps).
"""

from __future__ import annotations

import logging
import re
from typing import Any, FrozenSet, Iterable, Optional, Sequence, Set, Tuple

import torch

from ..core.errors import CheckpointingError, UnsafeContentError
from ..storage.safe_pickle import default_safe_globals, loads

logger = logging.getLogger(__name__)

_GLOBAL = re.compile(rb"c([A-Za-z_][\w.]*)\n([A-Za-z_]\w*)\n")
_OLD_MODULES = {"__builtin__": "builtins", "copy_reg": "copyreg"}  # protocol 2 spells Python 2's names


class LoadCheck:
    """What a run's saves learned: the name sets that load (each tried once), the refusals already said.

    ``safe_globals``: the types the run's loads allow beyond the defaults (the Lightning plugin sets its
    own ``extra_safe_globals``), so that a type the user allowed is not warned about."""

    def __init__(self, safe_globals: Sequence[Any] = ()) -> None:
        self.safe_globals: Tuple[Any, ...] = tuple(safe_globals)
        self.loadable: Set[FrozenSet[str]] = set()
        self.said: Set[str] = set()


def warn_unloadable(pickles: Iterable[Tuple[str, bytes]], target: str, check: Optional[LoadCheck]) -> None:
    """Rank 0 of a save: for each ``(what, pickled bytes)`` naming a global no allow-list holds, load it
    as a load will and log a refusal at WARNING (once per run and refusal where ``check`` is kept across
    saves). Never raises: the save goes on, as stock's does."""
    check = check if check is not None else LoadCheck()
    for what, data in pickles:
        names = frozenset(_names(data))
        if not names or names in check.loadable:
            continue
        allowed = _allowed(check.safe_globals, any(n.startswith("omegaconf.") for n in names))
        if all(n in allowed or _storage_type(n) for n in names):
            check.loadable.add(names)
            continue
        try:
            loads(data, f"save to {target}: {what}", check.safe_globals)
        except UnsafeContentError as e:
            said = str(e)
            if said.replace(target, "") not in check.said:  # each save of a run names its own target
                check.said.add(said.replace(target, ""))
                logger.warning("%s. The save goes on; allow the type before you resume from it", said)
            continue
        except CheckpointingError:  # anything else a load would say itself; not this warning's business
            continue
        except Exception as e:  # noqa: BLE001 - a check that cannot run must not fail the save
            logger.debug("save to %s: %s: the load check did not run: %s: %s", target, what, type(e).__name__, e)
            continue
        check.loadable.add(names)


def _names(data: bytes) -> Set[str]:
    out = set()
    for module, name in _GLOBAL.findall(data):
        m = module.decode("ascii")
        out.add(f"{_OLD_MODULES.get(m, m)}.{name.decode('ascii')}")
    return out


def _allowed(extra: Sequence[Any], omegaconf: bool) -> Set[str]:
    """Dotted names of what a load allows: torch's weights-only globals, the process's safe globals, ours
    (omegaconf's only where the pickle names it: importing it costs time)."""
    names: Set[str] = set()
    try:  # torch's own list (private: absent, every name is tried instead)
        from torch._weights_only_unpickler import _get_allowed_globals
        names.update(_get_allowed_globals())
    except Exception:  # noqa: BLE001 - only a shortcut
        pass
    for g in list(torch.serialization.get_safe_globals()) + default_safe_globals(omegaconf) + list(extra):
        g = g[0] if isinstance(g, tuple) else g  # (type, "name") pairs of add_safe_globals
        module, qual = getattr(g, "__module__", None), getattr(g, "__qualname__", None)
        if module and qual:
            names.add(f"{_OLD_MODULES.get(module, module)}.{qual}")
    return names


def _storage_type(name: str) -> bool:
    """torch's legacy storage classes (``torch.FloatStorage``): allowed by a rule, not by the list."""
    return name.startswith("torch.") and name.endswith("Storage") and "." not in name[len("torch."):]
