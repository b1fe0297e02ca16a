"""Pytest plugin that runs Lightning's own tests with lightning_distckpt injected (the peer-suite run).

Loaded by ``run.sh`` with ``-p ldc_harness``; ``LDC_PEER_MODE`` picks what every ``Trainer`` gets when
the test itself chose neither a checkpoint plugin nor a strategy of its own kind:

* ``stock``: nothing (the baseline).
* ``plugin``: ``plugins=[DistCheckpointIO()]``.
* ``async``: ``plugins=[DistCheckpointIO({"async_save": True})]`` (our background saves).
* ``lightning_async``: ``plugins=[AsyncCheckpointIO(DistCheckpointIO())]`` (Lightning's wrapper).
* ``stock_async``: ``plugins=[AsyncCheckpointIO(TorchCheckpointIO())]``: Lightning's wrapper around its
  own plugin, the baseline of ``lightning_async`` (no lightning_distckpt in it).
* ``strategy``: ``strategy=DistCheckpointStrategy()`` where the test runs the default / a DDP strategy.
* ``strategy_async``: the same with ``checkpoint={"async_save": True}``.
* ``strategy_async_bg``: the same with ``background_snapshot: true`` too (the Trainer's; Fabric's
  strategy gets ``strategy_async``'s config: it copies before returning).
* ``stock_ddp``: Lightning's own ``DDPStrategy`` where the strategy modes put ours (the Trainer's only;
  no lightning_distckpt in it): the baseline of the strategy modes, which tells failures of a DDP
  strategy on one process (where stock picks ``SingleDeviceStrategy``) from failures of ours.
* ``model_parallel``: no plugin or DDP replacement; instead a test module's own name
  ``ModelParallelStrategy`` (Lightning's, Trainer's or Fabric's) is rebound to our subclass
  (``DistCheckpointModelParallelStrategy`` / ``FabricDistCheckpointModelParallelStrategy``) before its
  tests run, and ``Trainer(strategy="model_parallel")`` gets ``"model_parallel_distckpt"``. Its baseline
  is ``stock`` on the same tests (``SUITE=model_parallel``).

``LDC_PEER_READTHROUGH=1`` also routes ``torch.load`` / Lightning's ``pl_load`` of a checkpoint
directory to ``DistCheckpointIO().load_checkpoint`` and makes ``os.path.isfile`` true for one: it
shows that the tests reading the checkpoint path as a single file themselves pass when the path is
read through our loader. Only in this harness: the package never patches torch or os.

``LDC_PEER_RESULTS``: a JSON-lines file receiving one row per test (node id, outcome, whether a
Trainer got our plugin / strategy, the failure's one-line reason); ``summarize.py`` counts them.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from typing import Any, Dict, List, Optional

import pytest

MODE = os.environ.get("LDC_PEER_MODE", "stock")
READTHROUGH = os.environ.get("LDC_PEER_READTHROUGH", "0") == "1"
RESULTS = os.environ.get("LDC_PEER_RESULTS")
MODES = ("stock", "plugin", "async", "lightning_async", "stock_async", "strategy", "strategy_async",
         "strategy_async_bg", "stock_ddp", "model_parallel")
PLUGIN_MODES = ("plugin", "async", "lightning_async", "stock_async")
#: Strategies the ``strategy`` modes replace (by name): the default and DDP on CPU.
DDP_NAMES = {None: None, "auto": None, "ddp": None, "ddp_spawn": "spawn", "ddp_fork": "fork",
             "ddp_notebook": "fork"}

_injected: List[str] = []  # what the current test's Trainers got


def _checkpoint_io() -> Any:
    from lightning.fabric.plugins import TorchCheckpointIO
    from lightning.pytorch.plugins.io import AsyncCheckpointIO

    from lightning_distckpt.lightning import DistCheckpointIO

    if MODE == "stock_async":
        return AsyncCheckpointIO(TorchCheckpointIO())
    if MODE == "plugin":
        return DistCheckpointIO()
    if MODE == "async":
        return DistCheckpointIO({"async_save": True})
    return AsyncCheckpointIO(DistCheckpointIO())


def _as_list(plugins: Any) -> List[Any]:
    if plugins is None:
        return []
    return list(plugins) if isinstance(plugins, (list, tuple)) else [plugins]


def _own_checkpoint_io(kwargs: Dict[str, Any]) -> bool:
    """Whether the test chose a checkpoint plugin itself (then it is left alone, except that in the
    plugin modes a wrapper given no base, ``AsyncCheckpointIO()``, gets ours instead of Lightning's)."""
    from lightning.fabric.plugins import CheckpointIO
    from lightning.pytorch.plugins.io.wrapper import _WrappingCheckpointIO
    from lightning.pytorch.strategies import Strategy

    from lightning_distckpt.lightning import DistCheckpointIO

    strategy = kwargs.get("strategy")
    if isinstance(strategy, Strategy) and strategy._checkpoint_io is not None:
        return True
    given = [p for p in _as_list(kwargs.get("plugins")) if isinstance(p, CheckpointIO)]
    for plugin in given:
        if isinstance(plugin, _WrappingCheckpointIO) and not plugin._base_checkpoint_io_configured \
                and MODE in PLUGIN_MODES and MODE != "stock_async":
            # Synchronous under Lightning's wrapper: its teardown does not reach the base plugin's.
            plugin.checkpoint_io = DistCheckpointIO()
            _injected.append("plugin (base of the test's wrapper)")
    return bool(given)


def _replaceable(strategy: Any) -> bool:
    """The default strategy, or DDP by name or as a plain ``DDPStrategy`` / ``SingleDeviceStrategy``."""
    from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy

    if isinstance(strategy, str) or strategy is None:
        return strategy in DDP_NAMES
    return type(strategy) in (DDPStrategy, SingleDeviceStrategy) and strategy._checkpoint_io is None


def _start_method(strategy: Any) -> Dict[str, Any]:
    """The launch the test's DDP strategy asked for (``ddp_spawn``, a ``DDPStrategy``'s), kept by the one put in."""
    from lightning.pytorch.strategies import DDPStrategy

    if isinstance(strategy, DDPStrategy):
        return {"start_method": strategy._start_method}
    return {"start_method": DDP_NAMES[strategy]} if DDP_NAMES.get(strategy) else {}


def inject(kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """``kwargs`` of a ``Trainer(...)`` with this mode's plugin or strategy added."""
    if MODE == "model_parallel":
        if kwargs.get("strategy") == "model_parallel":
            _injected.append("model_parallel")
            return dict(kwargs, strategy="model_parallel_distckpt")
        return kwargs
    if MODE == "stock" or _own_checkpoint_io(kwargs):
        return kwargs
    strategy = kwargs.get("strategy")
    if kwargs.get("accelerator") not in (None, "auto", "cpu") or not _replaceable(strategy):
        return kwargs
    out = dict(kwargs)
    if MODE == "stock_ddp":
        from lightning.pytorch.strategies import DDPStrategy

        out["strategy"] = DDPStrategy(**_start_method(strategy))
        _injected.append("stock_ddp")
    elif MODE.startswith("strategy"):
        from lightning_distckpt.lightning import DistCheckpointStrategy

        ddp_args = _start_method(strategy)
        config = {"async_save": True} if MODE.startswith("strategy_async") else None
        if MODE == "strategy_async_bg":
            config = {"async_save": True, "background_snapshot": True}
        out["strategy"] = DistCheckpointStrategy(checkpoint=config, **ddp_args)
        _injected.append("strategy")
    else:
        out["plugins"] = _as_list(kwargs.get("plugins")) + [_checkpoint_io()]
        _injected.append("plugin")
    return out


def _patch_fabric() -> None:
    """Fabric: a strategy left with no checkpoint plugin gets ours (the plugin modes) where Lightning
    would make a ``TorchCheckpointIO``; ``Fabric(strategy=<default / DDP>)`` gets
    ``FabricDistCheckpointStrategy`` (the strategy modes)."""
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import DDPStrategy, SingleDeviceStrategy
    from lightning.fabric.strategies.strategy import Strategy

    from lightning_distckpt.lightning import FabricDistCheckpointStrategy

    getter = Strategy.checkpoint_io.fget

    def checkpoint_io(self: Any) -> Any:
        if self._checkpoint_io is None and type(self) in (DDPStrategy, SingleDeviceStrategy) \
                and MODE in PLUGIN_MODES:
            self._checkpoint_io = _checkpoint_io()
            _injected.append("plugin")
        return getter(self)

    Strategy.checkpoint_io = property(checkpoint_io, Strategy.checkpoint_io.fset)  # type: ignore[assignment]
    original = Fabric.__init__

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        strategy = kwargs.get("strategy", "auto")
        # DDP by name only: Fabric's default is one device with no launch, which a DDP strategy needs.
        if MODE.startswith("strategy") and not args and str(strategy).startswith("ddp") and strategy in DDP_NAMES \
                and kwargs.get("accelerator") in (None, "auto", "cpu") and not _own_checkpoint_io(kwargs):
            start = {"start_method": DDP_NAMES[strategy]} if DDP_NAMES[strategy] else {}
            config = {"async_save": True} if MODE.startswith("strategy_async") else None
            kwargs = dict(kwargs, strategy=FabricDistCheckpointStrategy(checkpoint=config, **start))
            _injected.append("strategy")
        original(self, *args, **kwargs)
        # Made now, in this process: a spawned worker unpickles the strategy without this harness.
        if MODE in PLUGIN_MODES or MODE.startswith("strategy"):
            self.strategy.checkpoint_io  # noqa: B018

    Fabric.__init__ = __init__  # type: ignore[method-assign]


def _patch_model_parallel() -> None:
    """``model_parallel`` mode: each construction of our ModelParallel subclasses counts as injected."""
    from lightning_distckpt.lightning import (DistCheckpointModelParallelStrategy,
                                              FabricDistCheckpointModelParallelStrategy)

    for cls in (DistCheckpointModelParallelStrategy, FabricDistCheckpointModelParallelStrategy):
        def wrap(original: Any) -> Any:
            @functools.wraps(original)
            def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
                _injected.append("model_parallel")
                original(self, *args, **kwargs)
            return __init__
        cls.__init__ = wrap(cls.__init__)  # type: ignore[method-assign]


def pytest_collection_modifyitems(items: List[pytest.Item]) -> None:
    """``model_parallel`` mode: rebind a test module's ``ModelParallelStrategy`` (Lightning's) to ours."""
    if MODE != "model_parallel":
        return
    from lightning.fabric.strategies import ModelParallelStrategy as FabricStock
    from lightning.pytorch.strategies import ModelParallelStrategy as TrainerStock

    from lightning_distckpt.lightning import (DistCheckpointModelParallelStrategy,
                                              FabricDistCheckpointModelParallelStrategy)

    ours = {TrainerStock: DistCheckpointModelParallelStrategy, FabricStock: FabricDistCheckpointModelParallelStrategy}
    for item in items:
        module = item.getparent(pytest.Module)
        names = vars(module.obj) if module is not None else {}
        if names.get("ModelParallelStrategy") in ours:
            names["ModelParallelStrategy"] = ours[names["ModelParallelStrategy"]]


def _patch_trainer() -> None:
    from lightning.pytorch import Trainer

    original = Trainer.__init__

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **inject(kwargs))

    Trainer.__init__ = __init__  # type: ignore[method-assign]


# -- readthrough: a single-file read of our directory goes through our loader (harness only) ---------
def _ours(path: Any) -> bool:
    """A directory where a test expects a checkpoint file: ours, committed or with a background save
    in flight (then our loader commits it first, as it does before any load of that path)."""
    return isinstance(path, (str, os.PathLike)) and os.path.isdir(os.fspath(path))


def _read(path: Any, map_location: Any = None) -> Any:
    from lightning_distckpt.lightning import DistCheckpointIO

    where = map_location if isinstance(map_location, (str, type(None))) or hasattr(map_location, "type") else None
    return DistCheckpointIO().load_checkpoint(path, map_location=where)


def _patch_readthrough() -> None:
    import torch
    from lightning.fabric.utilities import cloud_io

    torch_load, pl_load, isfile = torch.load, cloud_io._load, os.path.isfile

    @functools.wraps(torch_load)
    def load(f: Any, map_location: Any = None, *args: Any, **kwargs: Any) -> Any:
        return _read(f, map_location) if _ours(f) else torch_load(f, map_location, *args, **kwargs)

    @functools.wraps(pl_load)
    def lightning_load(path_or_url: Any, map_location: Any = None, **kwargs: Any) -> Any:
        return _read(path_or_url, map_location) if _ours(path_or_url) else pl_load(path_or_url, map_location, **kwargs)

    def is_file(path: Any) -> bool:
        # Only a test's own check sees our directory as "the checkpoint file"; Lightning's and our code
        # (which tell a torch.save file from a directory by it) see the filesystem as it is.
        caller = sys._getframe(1).f_globals.get("__name__", "")
        return isfile(path) or (caller.startswith(("tests_pytorch.", "tests_fabric.")) and _ours(path))

    torch.load = load
    cloud_io._load = lightning_load
    os.path.isfile = is_file
    for module_name in ("lightning.pytorch.core.saving", "lightning.pytorch.utilities.migration.utils"):
        module = __import__(module_name, fromlist=["pl_load"])
        if getattr(module, "pl_load", None) is pl_load:
            module.pl_load = lightning_load


def pytest_configure(config: pytest.Config) -> None:
    if MODE not in MODES:
        raise pytest.UsageError(f"LDC_PEER_MODE={MODE!r}: one of {MODES}")
    _patch_trainer()
    _patch_fabric()
    if MODE == "model_parallel":
        _patch_model_parallel()
    if READTHROUGH:
        _patch_readthrough()


@pytest.fixture(autouse=True)
def _ldc_injected() -> Any:
    _injected.clear()
    yield


def _reason(report: pytest.TestReport) -> str:
    crash = getattr(report.longrepr, "reprcrash", None)
    text = crash.message if crash is not None else str(report.longrepr)
    return " ".join(text.split())[:300]


_rows: Dict[str, Dict[str, Any]] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    row = _rows.setdefault(report.nodeid, {"test": report.nodeid, "outcome": "passed", "injected": None, "reason": ""})
    if report.when == "call":
        row["injected"] = sorted(set(_injected)) or None
    if report.failed and row["outcome"] != "failed":
        row["outcome"] = "failed" if report.when == "call" else "error"
        row["reason"] = _reason(report)
    elif report.skipped and row["outcome"] == "passed":
        row["outcome"] = "xfailed" if hasattr(report, "wasxfail") else "skipped"


def pytest_sessionfinish(session: pytest.Session) -> None:
    if RESULTS:
        with open(RESULTS, "w") as f:
            for row in _rows.values():
                f.write(json.dumps(row) + "\n")


def pytest_report_header(config: pytest.Config) -> Optional[str]:
    import lightning_distckpt

    return (f"lightning_distckpt peer harness: mode={MODE} readthrough={READTHROUGH} "
            f"package={os.path.dirname(lightning_distckpt.__file__)}")
