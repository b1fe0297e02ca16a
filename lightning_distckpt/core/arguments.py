"""Checks of the public API's arguments: a value of the wrong type is an
:class:`~lightning_distckpt.core.errors.ArgumentTypeError` naming the argument, raised where the
call starts (not a TypeError or AttributeError from deep inside). Path arguments are checked by
:func:`lightning_distckpt.storage.paths.checkpoint_location` / ``local_path``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional, Tuple, Type, Union

from .errors import ArgumentError, ArgumentTypeError

Types = Union[Type[Any], Tuple[Type[Any], ...]]


def require(value: Any, types: Types, what: str, expected: str) -> None:
    """``value`` is an instance of ``types`` (``expected`` says so in words), else ArgumentTypeError."""
    if not isinstance(value, types):
        raise ArgumentTypeError(f"{what} must be {expected}, got {type(value).__name__}")


def require_bool(value: Any, what: str) -> None:
    """``value`` is a bool (an int or a string such as ``"no"`` would silently count as true)."""
    require(value, bool, what, "a bool")


def require_state_dict(value: Any, what: str) -> None:
    """``value`` is a (nested) state dict: a dict."""
    require(value, dict, what, "a dict (a nested state dict)")


def require_globals(value: Any, what: str = "extra_safe_globals") -> None:
    """``value`` is a list, tuple or set (of trusted types), not a string or a single type."""
    require(value, (list, tuple, set, frozenset), what, "a list or tuple of trusted types or functions")


def require_key_map(value: Any, what: str = "key_map") -> None:
    """``value`` is None, a mapping of names or a callable returning a name or None."""
    if value is not None and not isinstance(value, Mapping) and not callable(value):
        raise ArgumentTypeError(f"{what} must be None, a dict of names or a callable, got {type(value).__name__}")


def require_int_in(what: str, value: Any, low: int, high: Optional[int] = None, none_ok: bool = False) -> None:
    """``value`` is an int (not a bool) from ``low`` to ``high`` (None: no upper end), or None where
    ``none_ok``; else ArgumentError naming ``what``."""
    if value is None and none_ok:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        within = f">= {low}" if high is None else f"from {low} to {high}"
        raise ArgumentError(f"{what} must be {'None or ' if none_ok else ''}an int {within}, got {value!r}")
