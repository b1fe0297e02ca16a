"""The public API: at most 30 top-level names, each documented; the layers above the core in their own
subpackages, importable alone in a fresh interpreter without cycles; ``import lightning_distckpt``
does not import Lightning; the names of release 0.2 still resolve, with a DeprecationWarning naming
the new import."""

import inspect
import json
import subprocess
import sys
import warnings

import pytest
import torch

import lightning_distckpt as ldc
from lightning_distckpt import deprecated
from lightning_distckpt.core import errors


def _fresh(code: str) -> str:
    """Run ``code`` in a new interpreter (nothing imported yet) and return what it printed."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_at_most_30_top_level_names_each_documented():
    assert len(ldc.__all__) <= 30
    assert len(set(ldc.__all__)) == len(ldc.__all__)
    for name in ldc.__all__:
        obj = getattr(ldc, name)
        assert inspect.getdoc(obj), f"lightning_distckpt.{name} has no docstring"
        assert not name.startswith("_")


def test_every_error_class_the_library_defines_is_public():
    defined = {name for name, obj in vars(errors).items()
               if isinstance(obj, type) and issubclass(obj, errors.CheckpointingError)}
    assert defined <= set(ldc.__all__), defined - set(ldc.__all__)
    # ConfigError is a core error: the Lightning layer re-exports the same class
    assert ldc.ConfigError is errors.ConfigError


def test_import_does_not_import_lightning_nor_the_layers_above():
    loaded = json.loads(_fresh(
        "import json, sys, lightning_distckpt as ldc; ldc.ConfigError; ldc.validate; "
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] == 'lightning' "
        "or m.startswith(('lightning_distckpt.lightning', 'lightning_distckpt.export', 'lightning_distckpt.ingest')))))"))
    assert loaded == []


def test_the_command_line_and_plain_saves_do_not_import_dtensor(tmp_path):
    """torch.distributed.tensor (DTensor; ~0.7 s of sympy and op registrations at every start) is
    imported only where a DTensor can exist: not by the command line, nor by a save and load of
    plain and sharded tensors, whose results are exact."""
    code = f"""
import json, sys, torch, lightning_distckpt as ldc
from lightning_distckpt.cli.main import main
w = ldc.ShardedTensor.from_rank_offsets("w", torch.arange(6.0))
ldc.save({{"w": w, "plain": torch.ones(3), "step": 4}}, {str(tmp_path / "ck")!r})
out = ldc.load({{"w": ldc.ShardedTensor.from_rank_offsets("w", torch.zeros(6)), "plain": torch.zeros(3)}},
               {str(tmp_path / "ck")!r})
assert torch.equal(out["w"], torch.arange(6.0)) and torch.equal(out["plain"], torch.ones(3)) and out["step"] == 4
codes = [main(["inspect", {str(tmp_path / "ck")!r}]), main(["validate", {str(tmp_path / "ck")!r}])]
print(json.dumps([codes, [m for m in ("torch.distributed.tensor", "sympy") if m in sys.modules]]))
"""
    codes, loaded = json.loads(_fresh(code).splitlines()[-1])
    assert codes == [0, 0] and loaded == []


def test_each_subpackage_imports_first_without_a_cycle():
    """Each package imported first, with none of ours loaded (a module-level import cycle through it
    fails here). One interpreter: our modules are dropped from ``sys.modules`` between packages,
    torch and Lightning stay loaded (they are not ours and cost seconds each)."""
    code = """
import importlib, json, pkgutil, sys, traceback
import lightning_distckpt
packages = sorted(m.name for m in pkgutil.walk_packages(lightning_distckpt.__path__, "lightning_distckpt.") if m.ispkg)
failed = {}
for name in ["lightning_distckpt"] + packages:
    for m in [m for m in sys.modules if m.split(".")[0] == "lightning_distckpt"]:
        del sys.modules[m]
    try:
        importlib.import_module(name)
    except Exception:
        failed[name] = traceback.format_exc()
print(json.dumps([len(packages), failed]))
"""
    n, failed = json.loads(_fresh(code))
    assert n >= 10 and failed == {}


def test_export_torch_file_imports_lightning_only_for_lightning_checkpoints(tmp_path):
    ck, pt = tmp_path / "ck", tmp_path / "ck.pt"
    ldc.save({"w": ldc.ShardedTensor.from_rank_offsets("w", torch.arange(4.0)), "step": 1}, str(ck))
    code = (f"import json, sys; from lightning_distckpt import export; r = export.to_torch_file({str(ck)!r}, {str(pt)!r}); "
            f"b = export.from_torch_file({str(pt)!r}, {str(tmp_path / 'back')!r}); "
            "print(json.dumps([r.kind, b.kind, sorted(m for m in sys.modules if m.split('.')[0] == 'lightning')]))")
    assert json.loads(_fresh(code)) == ["tensors", "tensors", []]
    torch.testing.assert_close(ldc.load_plain_tensors(str(tmp_path / "back"))["w"], torch.arange(4.0))


def _new_object(module: str, attr: str):
    import importlib

    return getattr(importlib.import_module(module), attr)


@pytest.mark.parametrize("name", sorted(deprecated.DEPRECATED))
def test_old_top_level_name_warns_and_resolves_to_the_same_object(name):
    module, attr = deprecated.DEPRECATED[name]
    assert name not in ldc.__all__
    with pytest.warns(DeprecationWarning, match=rf"lightning_distckpt\.{name} is deprecated.*from {module} import {attr}"):
        old = getattr(ldc, name)
    assert old is _new_object(module, attr)


@pytest.mark.parametrize("old, new", [
    ("lightning_distckpt.export.export_safetensors", "to_safetensors"),
    ("lightning_distckpt.export.export_dcp", "to_dcp"),
    ("lightning_distckpt.export.export_megatron", "to_megatron"),
    ("lightning_distckpt.lightning.export_torch_file", "to_torch_file"),
    ("lightning_distckpt.lightning.import_torch_file", "from_torch_file"),
])
def test_old_subpackage_names_warn_and_resolve(old, new):
    import importlib

    package, name = old.rsplit(".", 1)
    with pytest.warns(DeprecationWarning, match=rf"{old} is deprecated.*lightning_distckpt\.export import {new}"):
        obj = getattr(importlib.import_module(package), name)
    assert obj is _new_object("lightning_distckpt.export", new)


def test_from_import_of_an_old_name_warns_at_the_caller():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        from lightning_distckpt import relayout_checkpoint  # noqa: F401
    where = {w.filename for w in caught if issubclass(w.category, DeprecationWarning)}
    assert where == {__file__}  # the import line, not our __getattr__


def test_unknown_names_still_raise_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        ldc.nope  # noqa: B018
    with pytest.raises(AttributeError):
        ldc.export.nope  # noqa: B018


def test_layers_are_attributes():
    assert ldc.export.to_safetensors.__module__ == "lightning_distckpt.export.safetensors_out"
    assert ldc.ingest.DistModule.__name__ == "DistModule"
    assert ldc.optim.optimizer_sharded_state_dict.__name__ == "optimizer_sharded_state_dict"
    assert {"export", "ingest", "lightning", "optim"} <= set(dir(ldc))
