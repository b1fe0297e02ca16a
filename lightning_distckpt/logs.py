"""Where the ``lightning_distckpt`` logger's records go.

* **Plain Python: nowhere, by default.** The package logger has a ``NullHandler`` (set in
  ``lightning_distckpt/__init__.py``), as a library's logger should: the application decides. To
  see the one line each save and load logs at INFO (bytes, seconds, rate)::

      import logging
      logging.basicConfig(level=logging.INFO)   # or DEBUG: per-rank I/O and per-stage times too

  (``logging.getLogger("lightning_distckpt").setLevel(logging.INFO)`` alone shows nothing: with
  no handler configured, Python's last-resort handler prints WARNING and above only.)
* **Under the Lightning Trainer or Fabric: beside Lightning's own messages.** When our Lightning
  plugin is set up (:class:`~lightning_distckpt.lightning.DistCheckpointIO`, which every strategy
  of ours uses), :func:`attach_to_lightning` lets the package logger print as Lightning's
  ``lightning.pytorch`` logger does, as if it were its child: at Lightning's level (INFO) unless
  the application set ours, through the handler Lightning installed on its logger (when the
  application had configured no logging before importing Lightning), and below WARNING only on
  global rank 0, as Lightning's ``rank_zero_info``. Loggers cannot be re-parented by name, so a
  handler on ours hands each record to Lightning's handlers. When the root logger has handlers
  (the application configured logging, or pytest's capture) that handler stays silent: our
  records propagate to the root logger like any library's, so nothing is printed twice and
  ``caplog`` sees them. The names a record carries (a checkpoint's keys and files) are escaped on
  the way to Lightning's terminal (:func:`~lightning_distckpt.core.shown.shown_message`).

Nothing here configures logging in plain Python, and an application's own settings of the
``lightning_distckpt`` logger (level, handlers) are kept.
"""

from __future__ import annotations

import copy
import logging
import sys
from typing import Any

from .core.shown import shown_message

PACKAGE_LOGGER = "lightning_distckpt"
# Trainer's logger first: ``import lightning`` configures both the same way.
_LIGHTNING_LOGGERS = ("lightning.pytorch", "lightning.fabric")


class _ToLightning(logging.Handler):
    """Hands each record to the handlers of a Lightning logger while the root logger has none;
    below WARNING only on global rank 0."""

    def __init__(self, target: logging.Logger, rank_source: Any) -> None:
        super().__init__()
        self.target = target
        self.rank_source = rank_source  # Lightning's rank_zero_only: its .rank is set by the strategies

    def emit(self, record: logging.LogRecord) -> None:
        if logging.getLogger().handlers:  # configured logging: the record propagates there
            return
        if record.levelno < logging.WARNING and getattr(self.rank_source, "rank", 0) != 0:
            return
        shown = copy.copy(record)  # escaped for Lightning's terminal; the record stays as it was for others
        shown.msg, shown.args = shown_message(record), None
        for handler in self.target.handlers:
            if record.levelno >= handler.level:
                handler.handle(shown)


def attach_to_lightning() -> None:
    """Print the package logger's records as Lightning prints its own (see the module docstring).
    Idempotent; does nothing when Lightning is not imported or the package logger has a handler of
    the application's (the CLI's, say)."""
    target_name = next((n for n in _LIGHTNING_LOGGERS if n in sys.modules), None)
    if target_name is None:
        return
    ours = logging.getLogger(PACKAGE_LOGGER)
    if any(not isinstance(h, logging.NullHandler) for h in ours.handlers):  # done, or the application's own
        return
    from lightning.fabric.utilities.rank_zero import rank_zero_only

    target = logging.getLogger(target_name)
    if ours.level == logging.NOTSET:  # the application has not chosen: Lightning's level
        ours.setLevel(target.getEffectiveLevel())
    ours.addHandler(_ToLightning(target, rank_zero_only))
