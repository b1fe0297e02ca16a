"""``strategy="ddp_distckpt"`` after only ``import lightning_distckpt``, without importing Lightning.

Lightning finds strategies by name in its registries (``lightning.pytorch.strategies.StrategyRegistry``
for the Trainer, ``lightning.fabric.strategies.STRATEGY_REGISTRY`` for Fabric). Our strategy classes
register themselves when ``lightning_distckpt.lightning`` is imported, but that imports Lightning
(seconds), which ``import lightning_distckpt`` must not do, and Lightning may not be installed.

So :func:`register_names` (called by ``lightning_distckpt/__init__.py``) registers a small factory
per name in each registry that exists: at once for a registry module already imported, otherwise
when Lightning imports it (a finder on ``sys.meta_path`` that answers for those two module names
only and runs the registration right after the module's own code; it removes itself once both are
done). A factory imports our strategy class when Lightning first builds the strategy; that import
registers the class itself in place of the factory (:func:`is_placeholder`), so the registry then
holds the class as if ``lightning_distckpt.lightning`` had been imported first. Without Lightning
nothing is imported and the finder never fires.
"""

from __future__ import annotations

import importlib
import importlib.abc
import logging
import sys
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

logger = logging.getLogger(__name__)

_DDP = "DDP with distributed checkpoints, start_method '{}'"
# registry module -> (its registry attribute, [(name, module, class, description, init params)])
Entry = Tuple[str, str, str, str, Dict[str, Any]]
REGISTRIES: Dict[str, Tuple[str, List[Entry]]] = {
    "lightning.pytorch.strategies": ("StrategyRegistry", [
        ("ddp_distckpt", "lightning_distckpt.lightning.strategy", "DistCheckpointStrategy", _DDP.format("popen"),
         {"start_method": "popen"}),
        ("ddp_distckpt_spawn", "lightning_distckpt.lightning.strategy", "DistCheckpointStrategy",
         _DDP.format("spawn"), {"start_method": "spawn"}),
        ("model_parallel_distckpt", "lightning_distckpt.lightning.model_parallel",
         "DistCheckpointModelParallelStrategy", "FSDP2 / tensor parallel with distributed checkpoints", {}),
    ]),
    "lightning.fabric.strategies": ("STRATEGY_REGISTRY", [
        ("ddp_distckpt", "lightning_distckpt.lightning.fabric", "FabricDistCheckpointStrategy", _DDP.format("popen"),
         {"start_method": "popen"}),
        ("ddp_distckpt_spawn", "lightning_distckpt.lightning.fabric", "FabricDistCheckpointStrategy",
         _DDP.format("spawn"), {"start_method": "spawn"}),
    ]),
}


def _factory(module: str, cls_name: str) -> Callable[..., Any]:
    """Builds ``module.cls_name(**init_params)``, importing it on first use."""

    def build(**init_params: Any) -> Any:
        return getattr(importlib.import_module(module), cls_name)(**init_params)

    build.__name__ = build.__qualname__ = cls_name
    build.__doc__ = f"{module}.{cls_name}, imported when Lightning first builds the strategy."
    build._distckpt_placeholder = True  # type: ignore[attr-defined]
    return build


def is_placeholder(entry: Any) -> bool:
    """Whether the registry entry ``entry`` (a dict with ``"strategy"``) is one of our factories,
    which the strategy class replaces when it registers itself."""
    return getattr(entry.get("strategy") if isinstance(entry, dict) else None, "_distckpt_placeholder", False)


def _register(module_name: str, module: Any) -> None:
    attr, entries = REGISTRIES[module_name]
    registry = getattr(module, attr, None)
    if registry is None:  # another Lightning version's layout: its strategies register on import
        return
    for name, cls_module, cls_name, description, init_params in entries:
        if name not in registry:
            registry.register(name, _factory(cls_module, cls_name), description=description, **init_params)


def _register_safely(module_name: str, module: Any) -> None:
    try:
        _register(module_name, module)
    except Exception as e:  # never break Lightning's import; `import lightning_distckpt.lightning` still registers
        logger.debug("could not register the lightning_distckpt strategy names in %s: %s", module_name, e)


class _Registering(importlib.abc.Loader):
    """The loader of a registry module, running the registration after the module's own code; the
    module keeps its own loader."""

    def __init__(self, loader: Any, name: str, done: Callable[[str], None]) -> None:
        self.loader, self.name, self.done = loader, name, done

    def create_module(self, spec: Any) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        module.__loader__ = module.__spec__.loader = self.loader
        self.loader.exec_module(module)
        self.done(self.name)
        _register_safely(self.name, module)

    def __getattr__(self, name: str) -> Any:  # get_source, resource readers, ...: the real loader's
        if name == "loader":
            raise AttributeError(name)
        return getattr(self.loader, name)


class _RegisterOnImport(importlib.abc.MetaPathFinder):
    """Answers only for the registry modules still to be registered (by finding them as the other
    finders would, then wrapping the loader)."""

    def __init__(self, names: Sequence[str]) -> None:
        self.pending = set(names)

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Optional[Any]:
        if fullname not in self.pending:
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None) if finder is not self else None
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _Registering(spec.loader, fullname, self._done)
        return spec

    def _done(self, name: str) -> None:
        self.pending.discard(name)
        if not self.pending and self in sys.meta_path:
            sys.meta_path.remove(self)


def register_names() -> None:
    """Register our strategy names in Lightning's registries now or when Lightning imports them."""
    later = []
    for name in REGISTRIES:
        module = sys.modules.get(name)
        if module is not None:
            _register_safely(name, module)
        else:
            later.append(name)
    if later and not any(isinstance(f, _RegisterOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterOnImport(later))
