"""``argparse`` types for the CLI's numeric options: a value that is not a finite number in range
(``nan``, ``inf``, ``-1``, ``0``, ``x``) is refused while parsing, as ``argparse`` refuses any bad
argument: one line naming the option and the value on stderr, exit status 2. Nothing reaches a
command with a number it would turn into a traceback or a silent default."""

from __future__ import annotations

import argparse
import math
from typing import Callable


def int_in(low: int, high: int) -> Callable[[str], int]:
    """An ``argparse`` type: a whole number in ``[low, high]``."""

    def parse(text: str) -> int:
        try:
            value = int(text.strip(), 10)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{value} is out of range: give a whole number from {low} to {high}")
        return value

    parse.__name__ = "int"  # argparse names the type in its message: "invalid int value"
    return parse


def float_in(low: float, high: float, low_inclusive: bool = False) -> Callable[[str], float]:
    """An ``argparse`` type: a finite number in ``(low, high]`` (``[low, high]`` with ``low_inclusive``)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
        if not (low <= value if low_inclusive else low < value) or value > high:
            bound = f"at least {low:.10g}" if low_inclusive else f"more than {low:.10g}"
            raise argparse.ArgumentTypeError(
                f"{value:.10g} is out of range: give a number {bound} and at most {high:.10g}")
        return value

    parse.__name__ = "float"
    return parse
