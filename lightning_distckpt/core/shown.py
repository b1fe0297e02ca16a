"""Untrusted text (a checkpoint's keys, file names, metadata strings) made safe to show to a person.

A checkpoint may come from anyone: a name in it can hold terminal escape sequences (clearing the
screen, setting the window title, an OSC 8 link), a carriage return or newline forging another
line (a fake ``OK``), bidi overrides reversing what follows, NUL, lone surrogates (which make
``print`` raise) or megabytes of text. :func:`shown` renders such text for a terminal or a log:
every control, format, surrogate, private-use, unassigned or line/paragraph-separator character
escaped as Python's ``repr`` writes it (``\\x1b``, ``\\n``, ``\\u202e``), and text over ``limit``
characters cut to its start and end with its length said. Ordinary text (letters, digits,
punctuation, spaces, in any script) comes back unchanged. JSON output needs none of this:
``json.dumps`` escapes control characters itself and keeps every name exact.
"""

from __future__ import annotations

import numbers
import unicodedata
from collections.abc import Mapping
from typing import Any, Optional

#: The most characters of a name (a key, a file name) shown whole.
NAME_LIMIT = 200
#: The most characters of a whole message line (an error, a problem found), names included.
MESSAGE_LIMIT = 4096

_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _unsafe(c: str) -> bool:
    # C*: controls (C0, DEL, C1), format characters (bidi overrides, zero-width), surrogates,
    # private use, unassigned; Zl / Zp: separators terminals and editors break lines at.
    category = unicodedata.category(c)
    return category[0] == "C" or category in ("Zl", "Zp")


def _escape(c: str) -> str:
    o = ord(c)
    return _NAMED.get(c) or (f"\\x{o:02x}" if o < 0x100 else f"\\u{o:04x}" if o < 0x10000 else f"\\U{o:08x}")


def _escaped(text: str) -> str:
    if text.isprintable():  # the common case, at C speed
        return text
    return "".join(_escape(c) if _unsafe(c) else c for c in text)


def shown(text: Any, limit: Optional[int] = NAME_LIMIT) -> str:
    """``text`` (a ``str``; anything else through ``str``) for a person to read: unsafe characters
    escaped, and, over ``limit`` characters (None: no limit), cut to its first three quarters and
    last fifth of ``limit`` around ``...``, its length said."""
    text = text if isinstance(text, str) else str(text)
    if limit is not None and len(text) > limit:  # cut first: escaping a huge name would be huge
        head, tail = text[:limit * 3 // 4], text[len(text) - limit // 5:]
        return f"{_escaped(head)}...{_escaped(tail)} ({len(text)} characters)"
    return _escaped(text)


def quoted(name: Any, limit: int = NAME_LIMIT) -> str:
    """``repr(name)`` (which escapes unsafe characters itself) for a message; a string over
    ``limit`` characters is :func:`shown` cut short, in quotes."""
    if isinstance(name, str) and len(name) > limit:
        return f"'{shown(name, limit)}'"
    return repr(name)


def shown_message(record: Any) -> str:
    """A ``logging.LogRecord``'s message with its arguments :func:`shown` (``%r`` of one: its own
    ``repr``, cut as :func:`quoted` cuts it): the format string is the library's, its line breaks
    kept; the names a checkpoint holds arrive as arguments. A record without arguments (or whose
    arguments a conversion needs unchanged: ``%d`` of a tensor) is shown whole."""
    if record.args:
        try:
            return str(record.msg) % _shown_args(record.args)
        except (TypeError, ValueError):
            pass
    return shown(record.getMessage(), MESSAGE_LIMIT)


def _shown_args(args: Any) -> Any:
    if isinstance(args, Mapping):  # logger.info("%(key)s", {"key": ...})
        return {k: _shown_arg(v) for k, v in args.items()}
    return tuple(_shown_arg(a) for a in args)


def _shown_arg(value: Any) -> Any:
    return value if value is None or isinstance(value, numbers.Number) else _ShownArg(value)


class _ShownArg(str):
    """An argument's text :func:`shown` (what ``%s`` prints); ``%r`` prints the argument's own ``repr``
    (which escapes unsafe characters itself), not the repr of the escaped text (every backslash doubled)."""

    def __new__(cls, value: Any) -> "_ShownArg":
        self = super().__new__(cls, shown(str(value), MESSAGE_LIMIT))
        self._repr = quoted(value, MESSAGE_LIMIT) if isinstance(value, str) else shown(repr(value), MESSAGE_LIMIT)
        return self

    def __repr__(self) -> str:
        return self._repr
