"""The API reference (docs/api.md, rendered by mkdocstrings) as a new user reads it: every ``:::`` name
resolves; every public name of the packages a user imports is on the page (or deliberately not, and
the page says so); every public function and class names each of its parameters in its docstring;
the docstrings' examples run (as written where they can, else the equivalent); the page shows no
Sphinx role (``:class:``) as literal text."""

from __future__ import annotations

import enum
import importlib
import inspect
import re
import warnings
from pathlib import Path
from typing import Any, Dict, Iterator, List, Tuple

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
API_MD = ROOT / "docs" / "api.md"
PACKAGES = ["lightning_distckpt", "lightning_distckpt.lightning", "lightning_distckpt.export",
            "lightning_distckpt.ingest", "lightning_distckpt.tiers", "lightning_distckpt.optim"]
# In a package's __all__ but not on the page, each for a reason the page states.
NOT_ON_PAGE = {
    "lightning_distckpt.lightning.ConfigError": "the very class lightning_distckpt.ConfigError, under Errors",
    "lightning_distckpt.ingest.ShardResult": "no public function returns one",
}
# Classes whose docstring says they take a Lightning class's arguments: their parameters must be that class's.
SAME_ARGUMENTS_AS = {"lightning_distckpt.lightning.DistModelCheckpoint": "lightning.pytorch.callbacks.ModelCheckpoint"}
# Classes the library builds and returns, never the caller: their constructor's parameters are internal.
LIBRARY_BUILT = {"lightning_distckpt.saving.async_request.AsyncSaveRequest": "never built by the caller"}
# A **kwargs the docstring covers as "Other arguments: as <Lightning strategy>".
OTHER_ARGUMENTS = re.compile(r"Other arguments: as ")


def _references() -> List[str]:
    return re.findall(r"^::: (\S+)", API_MD.read_text(), re.M)


def _resolve(path: str) -> Any:
    """``a.b.C.d`` -> the object: the longest importable module prefix, then attributes."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for name in parts[i:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(path)


def _public_names() -> Iterator[Tuple[str, Any]]:
    for package in PACKAGES:
        module = importlib.import_module(package)
        for name in module.__all__:
            yield f"{package}.{name}", getattr(module, name)


def _documented() -> Dict[int, str]:
    """id(object) -> its ``:::`` reference; a module's reference documents its public members too."""
    out: Dict[int, str] = {}
    for ref in _references():
        obj = _resolve(ref)
        out[id(obj)] = ref
        if inspect.ismodule(obj):
            for name, member in vars(obj).items():
                if not name.startswith("_") and getattr(member, "__module__", None) == obj.__name__:
                    out.setdefault(id(member), f"{ref}.{name}")
    return out


@pytest.mark.parametrize("ref", _references())
def test_every_reference_on_the_page_resolves(ref):
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)  # the page shows no deprecated name
        obj = _resolve(ref)
    assert inspect.getdoc(obj), f"docs/api.md ::: {ref} has no docstring"


def test_every_public_name_is_on_the_page_or_deliberately_not():
    documented = _documented()
    missing = [path for path, obj in _public_names() if id(obj) not in documented and path not in NOT_ON_PAGE]
    assert missing == [], f"public names missing from docs/api.md: {missing}"
    text = API_MD.read_text()
    for path in NOT_ON_PAGE:
        assert f"`{path}`" in text, f"docs/api.md does not say why {path} is not on the page"


def _callables() -> Iterator[Tuple[str, Any]]:
    seen = set()
    for path, obj in [*_public_names(), *((ref, _resolve(ref)) for ref in _references())]:
        if id(obj) in seen or inspect.ismodule(obj):
            continue
        seen.add(id(obj))
        if inspect.isclass(obj) and issubclass(obj, (enum.Enum, BaseException)):
            continue  # an Enum's signature is Enum's; an error class's is Exception's
        if callable(obj):
            yield path, obj


def _undocumented_parameters(path: str, obj: Any) -> List[str]:
    doc = inspect.getdoc(obj) or ""
    if inspect.isclass(obj) and obj.__init__ is not object.__init__:
        doc += "\n" + (inspect.getdoc(obj.__init__) or "")
    if path in LIBRARY_BUILT:
        return [] if LIBRARY_BUILT[path] in doc else [f"(say {LIBRARY_BUILT[path]!r})"]
    params = inspect.signature(obj).parameters.values()
    if path in SAME_ARGUMENTS_AS:
        module, name = SAME_ARGUMENTS_AS[path].rsplit(".", 1)
        base = inspect.signature(getattr(importlib.import_module(module), name)).parameters
        return [p.name for p in params if p.name not in base]
    out = []
    for p in params:
        if p.kind is p.VAR_KEYWORD and OTHER_ARGUMENTS.search(doc):
            continue
        if not re.search(rf"\b{re.escape(p.name)}\b", doc):
            out.append(p.name)
    return out


@pytest.mark.parametrize("path, obj", list(_callables()), ids=lambda v: v if isinstance(v, str) else "")
def test_every_public_callable_names_each_parameter(path, obj):
    assert inspect.getdoc(obj), f"{path} has no docstring"
    assert _undocumented_parameters(path, obj) == [], f"{path}: parameters its docstring does not name"


def test_the_checker_finds_an_unnamed_parameter():
    def f(checkpoint_dir: str, flattened: bool = False) -> None:
        """Read ``checkpoint_dir``."""

    def g(**ddp_kwargs: Any) -> None:
        """Args:
            Other arguments: as DDPStrategy."""

    assert _undocumented_parameters("f", f) == ["flattened"]
    assert _undocumented_parameters("g", g) == []
    assert _undocumented_parameters("lightning_distckpt.lightning.DistModelCheckpoint",
                                    _resolve("lightning_distckpt.lightning.DistModelCheckpoint")) == []


# A method overriding one of these frameworks' base-class methods (a Lightning hook, torch's ``forward``) needs its
# own docstring, saying what ours adds, but not its parameters named: they are the framework's, documented there.
FRAMEWORKS = ("lightning", "lightning_fabric", "pytorch_lightning", "torch")
# "Same arguments as :func:`lightning_distckpt.save`": the parameters that function has are named there.
SAME_AS = re.compile(r"Same arguments as\s+:(?:func|meth):`~?([\w.]+)`")


def _framework_hook(cls: type, name: str) -> bool:
    return any(name in vars(base) and base.__module__.split(".")[0] in FRAMEWORKS for base in cls.__mro__[1:])


def _methods() -> Iterator[Tuple[str, Any, bool]]:
    """``(path, function, is a framework hook)`` for each public method (classmethods and staticmethods too) a
    documented class defines itself; an inherited one is checked on the documented class that defines it."""
    for path, cls in _callables():
        if not inspect.isclass(cls):
            continue
        for name, member in vars(cls).items():
            fn = member.__func__ if isinstance(member, (classmethod, staticmethod)) else member
            if not name.startswith("_") and inspect.isfunction(fn):
                yield f"{path}.{name}", fn, _framework_hook(cls, name)


def _method_problems(path: str, fn: Any, hook: bool) -> List[str]:
    doc = inspect.getdoc(fn) or ""
    if not doc:
        return ["(no docstring)"]
    if hook:
        return []
    same = SAME_AS.search(doc)
    excused = set(inspect.signature(_resolve(same.group(1))).parameters) if same else set()
    params = [p for p in list(inspect.signature(fn).parameters)[1:] if p not in excused]  # not self / cls
    return [p for p in params if not re.search(rf"\b{re.escape(p)}\b", doc)]


@pytest.mark.parametrize("path, fn, hook", list(_methods()), ids=lambda v: v if isinstance(v, str) else "")
def test_every_public_method_names_each_parameter(path, fn, hook):
    """A user writing a store or calling a strategy reads methods: each documented class's public methods say
    what each parameter is (a framework hook: that it is one, and what ours adds)."""
    assert _method_problems(path, fn, hook) == [], f"{path}: parameters its docstring does not name"


def test_the_method_checker_finds_an_unnamed_parameter():
    from lightning.pytorch.plugins.io import CheckpointIO

    class Store(CheckpointIO):
        def save(self, state: Any, step: int) -> None:
            """Save ``state``."""

        def load_checkpoint(self, path: str, map_location: Any = None) -> Any:
            """Lightning's ``load_checkpoint``: ours reads any layout."""

        def remove_checkpoint(self, path: str) -> None:
            pass

        @classmethod
        def open(cls, where: str) -> "Store":
            """Same arguments as :func:`lightning_distckpt.save`."""

    found = {n: _method_problems(n, getattr(vars(Store)[n], "__func__", vars(Store)[n]), _framework_hook(Store, n))
             for n in ("save", "load_checkpoint", "remove_checkpoint", "open")}
    assert found == {"save": ["step"], "load_checkpoint": [], "remove_checkpoint": ["(no docstring)"],
                     "open": ["where"]}


def test_the_store_contract_is_on_the_page_with_its_members():
    """Every method of CheckpointStore is the store contract (docs/architecture.md, "The store"): on the page with
    the class, and each says how the library treats what it raises, or the class's rule covers it."""
    from lightning_distckpt.storage.store import CheckpointStore

    assert "::: lightning_distckpt.storage.store.CheckpointStore" in API_MD.read_text()
    class_doc = " ".join((inspect.getdoc(CheckpointStore) or "").split())
    assert "unless its docstring says otherwise" in class_doc and "every rank" in class_doc
    for name in CheckpointStore.__abstractmethods__:
        assert f"`{name}`" in (ROOT / "docs" / "architecture.md").read_text(), f"architecture.md omits {name}"
    paths = [path for path, _, _ in _methods() if path.startswith("lightning_distckpt.storage.store.CheckpointStore.")]
    assert len(paths) >= 25, paths


def _examples() -> Dict[str, str]:
    """Each public object's (and public method's) docstring example: ``Example::`` blocks and ``>>>`` lines."""
    out = {}
    for path, obj in _callables():
        members = [(path, obj)] + [(f"{path}.{n}", m) for n, m in vars(obj).items()
                                   if inspect.isclass(obj) and not n.startswith("_") and callable(m)]
        for where, member in members:
            doc = inspect.getdoc(member) or ""
            if "Example::" in doc or ">>>" in doc:
                out[where] = doc
    return out


def test_every_docstring_example_has_a_test_that_runs_it():
    """A new example fails here until a test below runs it (or its equivalent)."""
    assert sorted(_examples()) == ["lightning_distckpt.lightning.load_lightning_module"]


def test_load_lightning_module_example_runs(tmp_path):
    """``model = load_lightning_module(TinyGPT, "checkpoints/last.ckpt"); logits = model(tokens)``, with a
    real Lightning checkpoint directory: a Lightning checkpoint dict saved as one (``from_torch_file``)."""
    from lightning.pytorch import LightningModule

    from lightning_distckpt.export import from_torch_file
    from lightning_distckpt.lightning import load_lightning_module

    class TinyGPT(LightningModule):
        def __init__(self, vocab: int = 11, width: int = 4) -> None:
            super().__init__()
            self.save_hyperparameters()
            self.embed = torch.nn.Embedding(vocab, width)
            self.head = torch.nn.Linear(width, vocab)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            return self.head(self.embed(tokens))

    torch.manual_seed(0)
    trained = TinyGPT(vocab=13)
    lightning_dict = {"state_dict": trained.state_dict(), "hyper_parameters": dict(trained.hparams),
                      "pytorch-lightning_version": "2.4.0", "global_step": 7}
    torch.save(lightning_dict, tmp_path / "last.pt")
    assert from_torch_file(str(tmp_path / "last.pt"), str(tmp_path / "checkpoints" / "last.ckpt")).kind == "tree"

    model = load_lightning_module(TinyGPT, str(tmp_path / "checkpoints" / "last.ckpt"))
    tokens = torch.tensor([[1, 2, 12]])
    logits = model(tokens)
    assert model.hparams.vocab == 13 and not model.training
    torch.testing.assert_close(logits, trained(tokens))


def test_the_page_shows_no_sphinx_role_as_text(tmp_path):
    """mkdocstrings renders our docstrings as Markdown, where ``:class:`X``` is no markup; the mkdocs hook
    (tools/mkdocs_roles.py, named in mkdocs.yml) shows each as code, a ``~`` target by its last name."""
    import sys

    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import mkdocs_roles
    finally:
        sys.path.remove(str(ROOT / "tools"))
    html = ('see :class:<code>~lightning_distckpt.ingest.ShardOptions</code> and :func:<code>load</code>, '
            'not <code>a:b</code>')
    assert mkdocs_roles.on_page_content(html) == ("see <code>ShardOptions</code> and <code>load</code>, "
                                                  "not <code>a:b</code>")
    assert "tools/mkdocs_roles.py" in (ROOT / "mkdocs.yml").read_text()
