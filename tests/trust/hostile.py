"""Shared bounds for the hostile-input suites (tests/trust/): how many hypothesis cases a CI run
tries (derandomised, so CI is repeatable) and how many the ``long`` runs try.

``pytest -m long tests/trust`` runs the long versions; ``LDC_HOSTILE_EXAMPLES=N`` sets their count.
"""

import os

from hypothesis import HealthCheck, settings

SHORT = settings(max_examples=int(os.environ.get("LDC_HOSTILE_SHORT", "12")), deadline=None, derandomize=True,
                 suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
LONG = settings(max_examples=int(os.environ.get("LDC_HOSTILE_EXAMPLES", "500")), deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
