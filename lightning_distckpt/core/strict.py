"""How ``load`` treats keys that are missing from the checkpoint or present but not asked for."""

from __future__ import annotations

import logging
from enum import Enum
from typing import Iterable, Set, Tuple

from .errors import ArgumentError, MissingKeysError

logger = logging.getLogger(__name__)


class StrictHandling(Enum):
    """Key-mismatch handling on load, with Megatron-Core's names.

    "missing" keys are asked for but absent from the checkpoint; "unexpected" keys are in the
    checkpoint but asked for by no rank.

    * ``ASSUME_OK_UNEXPECTED``: do not look for unexpected keys (cheapest); missing keys raise.
    * ``LOG_UNEXPECTED`` / ``LOG_ALL``: log unexpected (and missing) keys; missing keys are skipped
      under ``LOG_ALL`` and raise under ``LOG_UNEXPECTED``.
    * ``RAISE_UNEXPECTED`` / ``RAISE_ALL``: raise on unexpected (and missing) keys.
    * ``RETURN_UNEXPECTED`` / ``RETURN_ALL``: ``load`` returns ``(state_dict, missing, unexpected)``;
      missing keys are skipped under ``RETURN_ALL`` and raise under ``RETURN_UNEXPECTED``.
    * ``IGNORE_ALL``: skip missing keys, ignore unexpected ones.

    Skipped missing entries keep their template value (the ShardedTensor's own ``data``).
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
    def parse(cls, value: "StrictHandling | str | bool") -> "StrictHandling":
        """Accept the enum, its name or value (any case), or a bool (True = RAISE_ALL, False = LOG_ALL)."""
        if isinstance(value, cls):
            return value
        if isinstance(value, bool):
            return cls.RAISE_ALL if value else cls.LOG_ALL
        if isinstance(value, str):
            v = value.strip().lower()
            for member in cls:
                if v in (member.value, member.name.lower()):
                    return member
        raise ArgumentError(f"unknown strict handling {value!r}; choose one of {[m.value for m in cls]}")

    @property
    def needs_unexpected(self) -> bool:
        return self not in (StrictHandling.ASSUME_OK_UNEXPECTED, StrictHandling.IGNORE_ALL)

    @property
    def skips_missing(self) -> bool:
        return self in (StrictHandling.LOG_ALL, StrictHandling.RETURN_ALL, StrictHandling.IGNORE_ALL)

    @property
    def returns_keys(self) -> bool:
        return self in (StrictHandling.RETURN_UNEXPECTED, StrictHandling.RETURN_ALL)


def check_keys(
    strict: StrictHandling, checkpoint_dir: str, missing: Iterable[str], unexpected: Iterable[str]
) -> Tuple[Set[str], Set[str]]:
    """Apply ``strict`` to the key sets: log or raise as the mode says; return them for RETURN_* modes."""
    missing, unexpected = set(missing), set(unexpected)
    where = f"checkpoint {checkpoint_dir}"
    if strict in (StrictHandling.LOG_UNEXPECTED, StrictHandling.LOG_ALL) and unexpected:
        logger.warning("%s: keys in the checkpoint not asked for: %s", where, sorted(unexpected))
    if strict is StrictHandling.LOG_ALL and missing:
        logger.warning("%s: keys asked for but missing (template kept): %s", where, sorted(missing))
    if strict is StrictHandling.RAISE_ALL and (missing or unexpected):
        raise MissingKeysError(
            f"{where}: missing keys {sorted(missing)}; unexpected keys {sorted(unexpected)} (strict={strict.value})"
        )
    if strict is StrictHandling.RAISE_UNEXPECTED and unexpected:
        raise MissingKeysError(f"{where}: unexpected keys {sorted(unexpected)} (strict={strict.value})")
    if missing and not strict.skips_missing:
        raise MissingKeysError(
            f"{where}: keys asked for but not in the checkpoint: {sorted(missing)} "
            f"(strict={strict.value}; use StrictHandling.LOG_ALL/IGNORE_ALL/RETURN_ALL to skip them)"
        )
    return missing, unexpected
