"""pytest plugin (``-p megatron_peer``) running Megatron-Core's ``tests/unit_tests/dist_checkpointing``
on CPU processes (gloo) under torchrun, with ``PEER_MODE=ours`` (Megatron-Core's ``save``/``load``/...
answered by lightning_distckpt, see ours.py) or ``PEER_MODE=megatron`` (its own, the baseline).

It replaces Megatron-LM's two conftest files (run with ``--noconftest``: the top one downloads data
sets), keeping their fixtures, and patches only Megatron-Core and its test helper ``Utils``:
``Utils.initialize_distributed`` makes a gloo group without touching CUDA, and a DeviceMesh asked
for on ``"cuda"`` is made on ``"cpu"``. Neither lightning_distckpt nor the test files are changed.
Each rank writes its own JUnit file (``PEER_OUT/rank<R>.xml``); summarize.py merges them.
"""

from __future__ import annotations

import logging
import os
import sys
import types
from datetime import timedelta
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist

MODE = os.environ.get("PEER_MODE", "ours")
_FUNCTIONS = ("save", "load", "load_tensors_metadata", "load_common_state_dict", "load_plain_tensors",
              "load_sharded_metadata")


def _route_to_ours() -> None:
    """Megatron-Core's module attributes the tests import, bound to ours (before the tests import them)."""
    import megatron.core.dist_checkpointing as mdc
    import megatron.core.dist_checkpointing.serialization as mser
    from ours import ROUTED

    for name in _FUNCTIONS:
        setattr(mdc, name, ROUTED[name])
        setattr(mser, name, ROUTED[name])


class _Unavailable(types.ModuleType):
    """``megatron.training`` (Megatron-LM's training loop, not in the megatron-core wheel; it imports
    triton) stands in for the test helpers' imports: any of its names raises when called, so a test
    that needs it fails naming it (those tests are not selected)."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)

        def unavailable(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError(f"{self.__name__}.{name} is not available on this CPU harness")
        return unavailable


def _stand_in_training() -> None:
    for name in ("megatron.training", "megatron.training.arguments", "megatron.training.training",
                 "megatron.training.utils", "megatron.training.checkpointing"):
        sys.modules.setdefault(name, _Unavailable(name))


def _cpu_only_cuda_calls() -> None:
    """Megatron-Core's save/load call CUDA unconditionally (synchronize, current_device, .cuda()):
    on a CPU-only torch those are no-ops here (as tests/conformance/megatron_side.py does)."""
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"
    torch.Tensor.cuda = lambda self, *a, **k: self


def _cpu_distributed() -> None:
    """Megatron-LM's Utils on CPU: a gloo world group from torchrun's environment."""
    from tests.unit_tests.test_utilities import Utils

    def initialize_distributed() -> None:
        if not dist.is_initialized() and Utils.rank >= 0:
            dist.init_process_group(backend="gloo", rank=Utils.rank, world_size=Utils.world_size,
                                    timeout=timedelta(seconds=float(os.environ.get("PEER_PG_TIMEOUT", "120"))))
            dist.barrier()
        Utils.inited = True

    Utils.initialize_distributed = staticmethod(initialize_distributed)
    destroy = Utils.destroy_model_parallel

    def destroy_model_parallel() -> None:
        """Also destroy the groups parallel_state made: each gloo group keeps its threads, and
        hundreds of tests' worth of them swamp a small CPU machine (NCCL groups are cheap in CI)."""
        destroy()
        if dist.is_initialized():
            from torch.distributed.distributed_c10d import GroupMember, _world

            for group in list(_world.pg_map):
                if group is not GroupMember.WORLD:
                    dist.destroy_process_group(group)

    Utils.destroy_model_parallel = staticmethod(destroy_model_parallel)
    from torch.distributed.device_mesh import DeviceMesh

    from_group = DeviceMesh.from_group

    def cpu_from_group(group, device_type, *args, **kwargs):  # type: ignore[no-untyped-def]
        return from_group(group, "cpu" if device_type == "cuda" else device_type, *args, **kwargs)

    DeviceMesh.from_group = staticmethod(cpu_from_group)


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    out = os.environ.get("PEER_OUT")
    if out:
        config.option.xmlpath = os.path.join(out, f"rank{os.environ.get('RANK', '0')}.xml")
    _stand_in_training()
    _cpu_distributed()
    _cpu_only_cuda_calls()
    if MODE == "ours":
        _route_to_ours()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Each outcome as it happens, one line per phase that did not simply pass, in
    ``PEER_OUT/rank<R>.log``: what a run killed at its time limit leaves (no JUnit file then)."""
    out = os.environ.get("PEER_OUT")
    if out and (report.when == "call" or not report.passed):
        line = (report.longreprtext or "").strip().splitlines()
        with open(os.path.join(out, f"rank{os.environ.get('RANK', '0')}.log"), "a") as f:
            f.write(f"{report.nodeid} {report.when} {report.outcome} {line[-1][:300] if line else ''}\n")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if exitstatus == 5:  # nothing collected on this rank: as Megatron-LM's conftest
        session.exitstatus = 0


@pytest.fixture(autouse=True)
def quiet_torch_debug_records() -> None:
    """torch's c10d and DCP loggers record each collective / DCP step at DEBUG, and the tests that
    assert ``caplog.text == ''`` see them (they are neither Megatron-Core's nor our records)."""
    for name in ("c10d-NullHandler-default", "c10d-NullHandler-dcp_logger"):
        logging.getLogger(name).setLevel(logging.INFO)


@pytest.fixture(autouse=True)
def experimental() -> None:
    from megatron.core import config

    config.ENABLE_EXPERIMENTAL = False


@pytest.fixture(scope="session", autouse=True)
def cleanup():  # type: ignore[no-untyped-def]
    yield
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


#: Test files whose tests write one file name in the shared directory with no barrier after reading it:
#: in test_safe_globals.py rank 0 writes the next test's file while a slower rank still reads this one's
#: (an UnpicklingError naming the next test's UnsafeClass, in either mode). Their ranks end each test together.
_END_TOGETHER = ("test_safe_globals.py",)


@pytest.fixture(autouse=True)
def end_together(request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    yield
    if request.node.path.name in _END_TOGETHER and dist.is_initialized():
        dist.barrier()


@pytest.fixture(autouse=True)
def reset_env_vars():  # type: ignore[no-untyped-def]
    original = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(original)


@pytest.fixture(scope="session")
def tmp_path_dist_ckpt() -> Path:
    """One directory shared by the ranks (run.sh makes it)."""
    return Path(os.environ["PEER_CKPT_TMP"])


@pytest.fixture(scope="class")
def tmp_dir_per_class(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("data")


@pytest.fixture(scope="session", autouse=True)
def set_default_dist_ckpt_strategy():  # type: ignore[no-untyped-def]
    """As Megatron-LM's dist_checkpointing/conftest.py: no MSC, torch_dist saves."""
    from megatron.core.dist_checkpointing.strategies.base import StrategyAction, get_default_strategy
    from megatron.core.msc_utils import MultiStorageClientFeature

    MultiStorageClientFeature.disable()

    def torch_dist() -> object:
        return get_default_strategy(StrategyAction.SAVE_SHARDED, "torch_dist", 1)

    with mock.patch("megatron.core.dist_checkpointing.serialization.get_default_save_sharded_strategy",
                    new=torch_dist) as patched:
        yield patched
