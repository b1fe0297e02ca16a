"""The toy tensor-parallel layers the examples use (``examples/tp_layers.py``, their one copy), for
the tests: that directory is put on ``sys.path`` (appended: nothing of the tests' is shadowed)."""

import os
import sys

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
if EXAMPLES not in sys.path:
    sys.path.append(EXAMPLES)

from tp_layers import ColumnParallelLinear, RowParallelLinear  # noqa: E402

__all__ = ["ColumnParallelLinear", "RowParallelLinear"]
