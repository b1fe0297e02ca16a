import faulthandler
import logging
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("OMP_NUM_THREADS", "1")


# What a launcher sets (script_ranks.LAUNCHER_VARS). A Trainer or Fabric run in the pytest process sets some
# of them (Lightning's environment picks a MASTER_PORT and writes it to os.environ); a later test's ranks
# would inherit a port that may be taken by then (seen: EADDRINUSE in a test run alone passing).
from script_ranks import LAUNCHER_VARS  # noqa: E402  (tests/ is on sys.path from the line above)


@pytest.fixture(autouse=True)
def _no_leaked_launcher_vars():
    before = {k: os.environ[k] for k in LAUNCHER_VARS if k in os.environ}
    yield
    for k in LAUNCHER_VARS:
        os.environ.pop(k, None)
    os.environ.update(before)


@pytest.fixture(autouse=True)
def _quiet_logs(caplog):
    caplog.set_level(logging.INFO, logger="lightning_distckpt")
    yield


@pytest.fixture
def isolated_process_group():
    """For a Trainer run in this (pytest) process: leave no process group or rendezvous variables
    (MASTER_PORT, WORLD_SIZE, ...) behind, or later tests' subprocesses would inherit them."""
    import torch.distributed as dist

    saved = dict(os.environ)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(saved)


# Tests live in folders by what they need; each folder is a marker (``pytest -m "not lightning"``,
# ``-m unit``), registered in pyproject.toml. ``slow`` marks the longest runs (``-m "not slow"``).
FOLDER_MARKERS = ("unit", "distributed", "lightning", "interop", "s3", "cli", "docs", "trust", "conformance", "tiers")


def pytest_collection_modifyitems(config, items):
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    for item in items:
        parts = os.path.relpath(str(item.path), tests_dir).split(os.sep)
        if len(parts) > 1 and parts[0] in FOLDER_MARKERS:
            item.add_marker(getattr(pytest.mark, parts[0]))


@pytest.hookimpl(trylast=True)  # after pytest's own faulthandler plugin, which points it at stderr
def pytest_configure(config):
    """``LDC_CRASH_DIR``: each process's (xdist worker's) Python stacks, every thread's, written to a file of
    its own there if it dies of a fatal signal. xdist reports only "node down" for a worker that segfaults;
    .ci/run prints these files when the run fails."""
    crash_dir = os.environ.get("LDC_CRASH_DIR")
    if crash_dir:
        name = os.environ.get("PYTEST_XDIST_WORKER", "main")
        config.ldc_crash_file = open(os.path.join(crash_dir, f"{name}.txt"), "w")  # open until the process ends
        faulthandler.enable(file=config.ldc_crash_file, all_threads=True)
