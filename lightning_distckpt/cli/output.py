"""What the CLI prints besides its result: log records and progress bars, set by the options every
command takes (before or after the command name):

* ``-v`` / ``--verbose``: INFO records (one line per save or load, what an export removed, ...);
  ``-vv``: DEBUG (per-rank and per-stage numbers). ``validate -v`` also names each key as checked.
* ``--log-level LEVEL``: ``debug``, ``info``, ``warning`` (the default), ``error``, ``critical``
  or a number from 1 to 50; wins over ``-v``.
* ``-q`` / ``--quiet``: no progress bar. Without it, long work draws a ``tqdm`` bar on stderr when
  stderr is a terminal (never into a pipe or a file).

The records of the ``lightning_distckpt`` logger go to stderr through a handler this module adds
for the command's duration (the package logger is otherwise silent: a ``NullHandler``). What
names a checkpoint holds reaches the terminal through :func:`shown` (every text output, every
record's message): its escape sequences, line breaks and bidi controls escaped, over-long names cut.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import json
import logging
import math
import os
import sys
from typing import Any, Iterator, Optional

from ..core.shown import shown_message
from ..progress import Progress, bar_wanted, progress_bar
from .numbers import int_in

LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR,
          "critical": logging.CRITICAL}
_LEVEL_NUMBER = int_in(1, 50)


def log_level(text: str) -> int:
    """An ``argparse`` type: a level name (any case) or a number from 1 to 50."""
    name = text.strip().lower()
    if name in LEVELS:
        return LEVELS[name]
    try:
        return _LEVEL_NUMBER(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a log level: give one of {', '.join(LEVELS)} or a number from 1 to 50") from None


log_level.__name__ = "log level"  # argparse's message: "invalid log level value"


def output_options() -> argparse.ArgumentParser:
    """The options of every command, as a parent parser. Their defaults are left out of the
    namespace (``SUPPRESS``), so a value given before the command name is not reset by the
    subcommand's parser: read them with :func:`level_of` / :func:`quiet_of`."""
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("output")
    g.add_argument("-v", "--verbose", action="count", default=argparse.SUPPRESS,
                   help="log INFO records (-vv: DEBUG) on stderr; validate: also name each key as it is checked")
    g.add_argument("-q", "--quiet", action="store_true", default=argparse.SUPPRESS,
                   help="no progress bar (drawn on stderr only when it is a terminal)")
    g.add_argument("--log-level", type=log_level, default=argparse.SUPPRESS, metavar="LEVEL",
                   help="debug, info, warning (default), error, critical, or a number from 1 to 50 (wins over -v)")
    return p


def verbosity(args: argparse.Namespace) -> int:
    return int(getattr(args, "verbose", 0) or 0)


def level_of(args: argparse.Namespace) -> int:
    """The logging level the options ask for."""
    if getattr(args, "log_level", None) is not None:
        return int(args.log_level)
    return {0: logging.WARNING, 1: logging.INFO}.get(verbosity(args), logging.DEBUG)


def quiet_of(args: argparse.Namespace) -> bool:
    return bool(getattr(args, "quiet", False))


class ShownFormatter(logging.Formatter):
    """Records with their arguments :func:`shown` (:func:`~lightning_distckpt.core.shown.shown_message`):
    the library logs names a checkpoint holds (keys, files) as arguments, and a forged line or an
    escape sequence in a log reads like the library's own."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        record = copy.copy(record)  # other handlers (an application's, pytest's) see the record as it was
        record.message = shown_message(record)
        return super().formatMessage(record)


@contextlib.contextmanager
def command_logging(args: argparse.Namespace) -> Iterator[None]:
    """The package logger printed to stderr at the options' level while a command runs; its level
    and handlers are put back afterwards (``main()`` may be called in a running program)."""
    logger = logging.getLogger("lightning_distckpt")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(ShownFormatter("%(levelname)s %(name)s: %(message)s"))
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(level_of(args))
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)


def emit(text: str) -> None:
    """Print a command's result on stdout. Characters its encoding lacks (a key in Japanese on an
    ASCII or Latin-1 stdout) are written as Python's escapes, not a UnicodeEncodeError traceback; a
    reader gone (``| head``) ends the printing, not the command: its exit status (``validate``'s
    verdict) is still its own."""
    stream = sys.stdout
    try:
        try:  # a text stream encodes the whole text before it writes any: a refused one wrote nothing
            print(text, file=stream)
        except UnicodeEncodeError:
            encoding = getattr(stream, "encoding", None) or "ascii"
            print(text.encode(encoding, "backslashreplace").decode(encoding), file=stream)
        stream.flush()
    except BrokenPipeError:
        try:  # Python flushes stdout again at exit: into /dev/null, that flush has nothing left to fail on
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, stream.fileno())
            os.close(devnull)
        except (OSError, ValueError, io.UnsupportedOperation):  # no file descriptor (an embedding program's stream)
            pass


def json_text(data: Any) -> str:
    """``--json``'s text: strict JSON (RFC 8259). A NaN or infinity a checkpoint's metadata holds
    (``json.loads`` reads them) is ``null``: ``json.dumps`` wrote ``NaN``, which jq, JavaScript and
    most other parsers refuse. Every string is ASCII (JSON's escapes): any terminal, any encoding."""
    try:
        return json.dumps(data, indent=1, allow_nan=False)
    except ValueError:  # only then walked: a summary of millions of keys is dumped once
        return json.dumps(_finite(data), indent=1, allow_nan=False)


def _finite(data: Any) -> Any:
    if isinstance(data, float) and not math.isfinite(data):
        return None
    if isinstance(data, dict):
        return {k: _finite(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [_finite(v) for v in data]
    return data


#: Work that is usually quick (``inspect``, ``clean``) draws its bar only once it has taken this long
#: (a bar that appeared is cleared at the end): a quick command prints nothing but its result.
QUICK_BAR_DELAY_S = 0.5


def bar(args: argparse.Namespace, desc: str, unit: str = "B",
        quick: bool = False) -> "contextlib.AbstractContextManager[Optional[Progress]]":
    """The command's progress bar (None in a pipe, a file, or with ``--quiet``); ``quick``: after
    :data:`QUICK_BAR_DELAY_S` only."""
    return progress_bar(bar_wanted(quiet_of(args)), desc, unit, delay=QUICK_BAR_DELAY_S if quick else 0.0)
