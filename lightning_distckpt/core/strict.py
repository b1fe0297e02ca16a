"""How ``load`` treats a template and a checkpoint whose keys differ: Megatron-Core's
``StrictHandling`` modes, with Megatron-Core's meaning of "unexpected" and "missing"."""

from __future__ import annotations

import contextlib
import difflib
import logging
from contextvars import ContextVar
from enum import Enum
from typing import AbstractSet, Collection, FrozenSet, Iterable, Iterator, Optional, Set, Tuple

from .errors import ArgumentError, MissingKeysError
from .shown import quoted

logger = logging.getLogger(__name__)
_COMPILED = "_orig_mod."  # torch.compile's OptimizedModule holds the module under this name
# How each entry point skips keys its template asks for but the checkpoint lacks.
SKIP_HINT = ("to skip them: load(..., strict=StrictHandling.LOG_UNEXPECTED / LOG_ALL / RETURN_ALL / IGNORE_ALL); "
             "load_module_weights / fabric.load: strict=False; a Trainer under our strategies: "
             "LightningModule.strict_loading = False, or the checkpoint config's strict: log_all")
# What a refusal of a module's checkpoint weights it does not ask for says (Lightning's strict_loading).
UNUSED_LABEL = ("[strict_loading=True / fabric.load(strict=True): every module weight of the checkpoint must be "
                "used, as load_state_dict(strict=True) requires]")
UNUSED_HINT = ("to leave them unused: LightningModule.strict_loading = False or fabric.load(..., strict=False) (they "
               "are logged), or set the checkpoint config's strict (e.g. assume_ok_unexpected: Megatron-Core's "
               "meaning, which does not look for them)")
# The checkpoint's keys of the module entries whose unasked ones a load refuses (None: none refused), and where
# a deferred refusal collects them; set by :func:`refusing_unused` around one load, read by the key match
# (reading/request.py), which every rank makes.
_REFUSED_UNUSED: ContextVar[Optional[Tuple[FrozenSet[str], Optional[Set[str]]]]] = ContextVar("ldc_refused_unused",
                                                                                          default=None)
_DEFERRED_ABSENT: ContextVar[Optional[Set[str]]] = ContextVar("ldc_deferred_absent", default=None)


class StrictHandling(Enum):
    """Key-mismatch handling on load, with Megatron-Core's names and meaning.

    * *unexpected* keys are asked for by a rank's template but are not in the checkpoint (each rank
      has its own);
    * *missing* keys are in the checkpoint but asked for by no rank (the same on every rank; only
      the ``*_ALL`` modes look for them, since that compares every rank's request).

    PyTorch's ``load_state_dict`` (and Lightning's ``strict=True/False``) uses the two words the
    other way round.

    * ``ASSUME_OK_UNEXPECTED`` (default): unexpected keys raise; missing keys are not looked for.
    * ``LOG_UNEXPECTED``: unexpected keys are logged (WARNING) and skipped.
    * ``LOG_ALL``: unexpected and missing keys are logged; unexpected keys are skipped.
    * ``RAISE_UNEXPECTED``: unexpected keys raise; missing keys are not looked for.
    * ``RAISE_ALL``: unexpected or missing keys raise.
    * ``RETURN_UNEXPECTED``: ``load`` returns ``(state_dict, set(), unexpected)``; unexpected keys
      are skipped.
    * ``RETURN_ALL``: ``load`` returns ``(state_dict, missing, unexpected)``; unexpected keys are
      skipped.
    * ``IGNORE_ALL``: unexpected keys are skipped silently.

    A skipped entry keeps its template value (the ShardedTensor's own ``data``; Megatron-Core
    drops it from the result). A raise happens on every rank alike, naming every rank's
    unexpected keys; a returned or logged ``unexpected`` set is this rank's own, as in Megatron-Core.
    """

    ASSUME_OK_UNEXPECTED = "assume_ok_unexpected"
    LOG_UNEXPECTED = "log_unexpected"
    LOG_ALL = "log_all"
    RAISE_UNEXPECTED = "raise_unexpected"
    RAISE_ALL = "raise_all"
    RETURN_UNEXPECTED = "return_unexpected"
    RETURN_ALL = "return_all"
    IGNORE_ALL = "ignore_all"

    @classmethod
    def parse(cls, value: "StrictHandling | Enum | str | bool") -> "StrictHandling":
        """Accept the enum, Megatron-Core's own ``StrictHandling`` member, a mode's name or value (any
        case), or a bool (True = RAISE_ALL, False = LOG_ALL)."""
        if isinstance(value, cls):
            return value
        if isinstance(value, bool):
            return cls.RAISE_ALL if value else cls.LOG_ALL
        if isinstance(value, Enum) and isinstance(value.value, str):  # megatron.core's enum: same values
            value = value.value
        if isinstance(value, str):
            v = value.strip().lower()
            for member in cls:
                if v in (member.value, member.name.lower()):
                    return member
        raise ArgumentError(f"unknown strict handling {value!r}; choose one of {[m.value for m in cls]}")

    @property
    def needs_missing(self) -> bool:
        """Whether the load looks for missing keys (checkpoint keys no rank asks for): the ranks'
        requested keys are then compared (a digest each; the keys only when the digests differ)."""
        return self in (StrictHandling.LOG_ALL, StrictHandling.RAISE_ALL, StrictHandling.RETURN_ALL)

    @property
    def skips_unexpected(self) -> bool:
        """Whether keys asked for but absent from the checkpoint are skipped (keeping the template's
        value) rather than raised on."""
        return self not in (StrictHandling.ASSUME_OK_UNEXPECTED, StrictHandling.RAISE_UNEXPECTED,
                            StrictHandling.RAISE_ALL)

    @property
    def returns_keys(self) -> bool:
        """Whether ``load`` returns ``(state_dict, missing, unexpected)``."""
        return self in (StrictHandling.RETURN_UNEXPECTED, StrictHandling.RETURN_ALL)


@contextlib.contextmanager
def refusing_unused(stored_keys: Optional[AbstractSet[str]], found: Optional[Set[str]] = None) -> Iterator[None]:
    """Within the block, a load refuses those of ``stored_keys`` (a checkpoint's keys, the same on every rank: a
    module's entries) that no rank asks for, whatever the mode's Megatron-Core meaning: Lightning's
    ``strict_loading`` / Fabric's ``strict=True`` for a module, scoped to its weights. None: nothing more refused.
    ``found``: the refusal is deferred: the load adds those keys to ``found`` (the same on every rank) and its
    caller refuses the ones still there after the user's hooks (:func:`refuse_unused`), as stock's
    ``load_state_dict(strict=True)`` sees the checkpoint only after ``on_load_checkpoint`` and its pre-hooks.
    A context (not an argument of ``load``, whose signature is Megatron-Core's), set by the strategies."""
    token = _REFUSED_UNUSED.set(None if stored_keys is None else (frozenset(stored_keys), found))
    try:
        yield
    finally:
        _REFUSED_UNUSED.reset(token)


def refused_unused() -> Optional[FrozenSet[str]]:
    """The keys :func:`refusing_unused` set for the load in progress (None: none)."""
    scope = _REFUSED_UNUSED.get()
    return None if scope is None else scope[0]


def deferred_unused() -> Optional[Set[str]]:
    """Where the load in progress collects the unused keys it leaves to its caller to refuse (None: it refuses
    them itself)."""
    scope = _REFUSED_UNUSED.get()
    return None if scope is None else scope[1]


@contextlib.contextmanager
def deferring_absent(held: Set[str]) -> Iterator[None]:
    """Within the block, a load whose module weights no rank asks for are left to its caller
    (:func:`refusing_unused` with ``found``) does not refuse the keys asked for but absent from the checkpoint
    either: it adds them (every rank's, the same everywhere) to ``held`` and skips them. A user's hook may rename
    one of those weights onto them (a renamed layer), as stock's ``load_state_dict`` checks its missing keys only
    after ``on_load_checkpoint`` and its pre-hooks; the caller refuses the ones no hook filled."""
    token = _DEFERRED_ABSENT.set(held)
    try:
        yield
    finally:
        _DEFERRED_ABSENT.reset(token)


def deferred_absent() -> Optional[Set[str]]:
    """Where the load in progress puts the absent keys it leaves to its caller (:func:`deferring_absent`)."""
    return _DEFERRED_ABSENT.get()


def refuse_unused(checkpoint_dir: str, unused: AbstractSet[str]) -> None:
    """Refuse a checkpoint's module weights no rank asks for (a deferred :func:`refusing_unused`), in the words
    the load itself refuses them with; nothing when ``unused`` is empty."""
    if unused:
        check_keys(StrictHandling.ASSUME_OK_UNEXPECTED, checkpoint_dir, (), (), (), unasked=set(unused),
                   unused=set(unused))


def mismatch_message(missing: AbstractSet[str], unexpected: AbstractSet[str], unexpected_whose: str) -> str:
    """Megatron-Core's wording of a key mismatch (log scrapers look for "Missing keys" /
    "Unexpected keys"), each set sorted; a checkpoint's keys are anyone's: each is :func:`quoted`."""
    titles, bodies = [], []
    if missing:
        titles.append("Some keys found in the checkpoint are missing in the provided sharded state dict.")
        bodies.append(f"Missing keys (for all ranks): {_listed(missing)}.")
    if unexpected:
        titles.append("Unexpected keys (not found in the checkpoint) encountered in the provided sharded state dict.")
        bodies.append(f"Unexpected keys ({unexpected_whose}): {_listed(unexpected)}.")
    return " ".join(titles) + "\n" + " ".join(bodies)


def _listed(keys: AbstractSet[str], shown: int = 10) -> str:
    """``str(sorted(keys))``, each key :func:`quoted`: escaped as ``repr`` does, a long one cut short;
    past ``shown`` keys, the first ones and how many there are (a renamed prefix may miss thousands)."""
    first = sorted(keys)[:shown]
    more = f", ... ({len(keys)} in all)" if len(keys) > shown else ""
    return f"[{', '.join(quoted(k) for k in first)}{more}]"


def check_keys(strict: StrictHandling, checkpoint_dir: str, missing: Iterable[str], unexpected_any_rank: Iterable[str],
               unexpected_mine: Iterable[str], stored: Collection[str] = (),
               unasked: Optional[AbstractSet[str]] = None,
               unused: AbstractSet[str] = frozenset()) -> Tuple[Set[str], Set[str]]:
    """Apply ``strict`` to a load's key mismatch: raise (the same on every rank: every rank passes
    the same ``missing``, ``unexpected_any_rank`` and ``unasked``) or log (this rank's own) as the mode says.
    Returns ``(missing, unexpected_mine)`` as ``load`` returns them: empty where the mode does not
    report a set (``missing`` outside ``LOG_ALL`` / ``RAISE_ALL`` / ``RETURN_ALL``, both under
    ``IGNORE_ALL``). ``stored``: the checkpoint's keys, for the close ones an error suggests.
    ``unasked``: the checkpoint's keys no rank asks for, where known (None: the ranks ask for
    different keys and the mode did not compare them), which a refusal names beside the keys it
    refuses, as torch's ``load_state_dict`` names both sides. ``unused``: those of them that are refused
    whatever ``strict`` says (a module's weights under Lightning's ``strict_loading``, :func:`refusing_unused`)."""
    missing = set(missing) if strict.needs_missing else set()
    every, mine = set(unexpected_any_rank), set(unexpected_mine)
    where = f"checkpoint {checkpoint_dir}"
    if strict is StrictHandling.IGNORE_ALL:
        return set(), set()
    refused = (missing if strict is StrictHandling.RAISE_ALL else set()) | set(unused)
    if (every and not strict.skips_unexpected) or refused:
        shown, other = refused, ""
        if every and not refused:  # the checkpoint's side of the mismatch, which this mode does not refuse
            shown, other = _other_side(strict, unasked)
        hint = f" ({SKIP_HINT})" if every else f" ({UNUSED_HINT})" if unused else ""
        label = f"[strict={strict.value}]" if every or not unused or strict is StrictHandling.RAISE_ALL else ""
        if unused and strict is not StrictHandling.RAISE_ALL:  # refused by Lightning's flag, not by the mode
            label = f"{label} {UNUSED_LABEL}".strip()
        # a close key is one the template does not ask for already: not a layer both sides have
        close = _close_keys(every, stored if unasked is None else unasked)
        if every and stored and not close and refused <= unused:  # a renamed layer: nothing to guess; where to look
            close = f" The checkpoint's keys: python -m lightning_distckpt inspect {checkpoint_dir}"
        raise MissingKeysError(f"{where}: {mismatch_message(shown, every, 'of all ranks')}{other} "
                               f"{label}{hint}{close}")
    if strict in (StrictHandling.LOG_UNEXPECTED, StrictHandling.LOG_ALL) and (missing or mine):
        kept = " (skipped: their template values are kept)" if mine else ""
        logger.warning("%s: %s%s", where, mismatch_message(missing, mine, "for this rank"), kept)
    return missing, mine


def _other_side(strict: StrictHandling, unasked: Optional[AbstractSet[str]]) -> Tuple[Set[str], str]:
    """What a refusal of keys the checkpoint lacks says of the checkpoint's keys no rank asks for,
    under a mode that does not refuse those: ``(keys to list as missing, a note)``."""
    if unasked is None:
        return set(), (" The checkpoint's keys no rank asks for are not listed: the ranks ask for different "
                       "keys (strict=raise_all compares them).")
    if not unasked:
        return set(), " Every key of the checkpoint is asked for: the template has entries the checkpoint lacks."
    return set(unasked), f" (Missing keys are listed to show both sides; strict={strict.value} does not refuse them.)"


def _close_keys(unexpected: AbstractSet[str], stored: Collection[str], shown: int = 5) -> str:
    """The checkpoint's keys close to the first unexpected ones (a misspelled or renamed template
    key): `` Did you mean: 'a.weight' for 'a.wieght'?``; "" when none is close. A key that differs only
    by ``torch.compile``'s ``_orig_mod.`` (a submodule compiled on one side only) is named as such: its
    plain spelling is too far from the compiled one for a close match of short keys."""
    uncompiled = {k.replace(_COMPILED, ""): k for k in stored if _COMPILED in k}
    stored_set = set(stored)
    pairs, compiled = [], False
    for key in sorted(unexpected)[:shown]:
        match = uncompiled.get(key) or (key.replace(_COMPILED, "") if _COMPILED in key else None)
        if match is not None and match in stored_set:
            close, compiled = [match], True
        else:
            close = difflib.get_close_matches(key, stored, 1, 0.8) if stored else []
        if close:
            pairs.append(f"{quoted(close[0])} for {quoted(key)}")
    hint = (f" ({_COMPILED!r} is what torch.compile adds to a compiled submodule's keys: compile the same "
            "submodules as the saved model, or the whole model, which Lightning and Fabric unwrap)") if compiled else ""
    return f" Did you mean: {', '.join(pairs)}? (checkpoint keys){hint}" if pairs else ""
