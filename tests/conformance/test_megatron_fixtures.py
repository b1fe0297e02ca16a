"""The ``torch_dist`` checkpoints of every Megatron-Core release that writes one (0.12-0.16: see
``tests/fixtures/megatron/build.py``, which wrote them) load exactly under another split on 2 gloo
processes, whole in one process, and through ``inspect`` / ``validate``; megatron-core's own load
(the installed release) reads each the same. The ``.metadata`` of 0.12-0.15 pickles megatron-core
classes (``MCoreSavePlan``, 0.15's ``MCoreMetadata``): read without megatron-core's code."""

from __future__ import annotations

import json
import os

import pytest
import torch

import lightning_distckpt as ldc
from dist_utils import run_distributed
from lightning_distckpt.reading.formats.dcp_metadata import _AllowListUnpickler
from fixtures.megatron import build

from .megatron_side import FIXTURES, cpu_only_megatron, versions

VERSIONS = versions()


def test_every_release_has_a_fixture():
    assert {".".join(v.split(".")[:2]) for v in VERSIONS} >= {"0.12", "0.13", "0.14", "0.15", "0.16"}
    for version in VERSIONS:
        path = os.path.join(FIXTURES, version)
        with open(os.path.join(path, "metadata.json")) as f:
            assert json.load(f)["sharded_backend"] == "torch_dist"
        assert sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path)) < 64 << 10  # small


def _globals(path: str) -> set:
    """The module.name globals the pickle at ``path`` names, as our allow-list unpickler meets them."""
    found = set()

    class Recording(_AllowListUnpickler):
        def find_class(self, module, name):
            found.add(f"{module}.{name}")
            return super().find_class(module, name)

    with open(path, "rb") as f:
        Recording(f, path).load()
    return found


def test_older_releases_pickle_megatron_classes():
    """What the fixtures exercise: megatron-core's classes in the metadata of 0.12-0.15, none in 0.16."""
    mcore = "megatron.core.dist_checkpointing.strategies.torch."
    for version in VERSIONS:
        named = {g for g in _globals(os.path.join(FIXTURES, version, ".metadata")) if g.startswith("megatron")}
        if version.startswith("0.16"):
            assert named == set(), version
        else:
            assert mcore + "MCoreSavePlan" in named, version
    assert mcore + "MCoreMetadata" in _globals(os.path.join(FIXTURES, next(v for v in VERSIONS if
                                                                          v.startswith("0.15")), ".metadata"))


def _load_each(rank: int, world: int) -> None:
    """Every fixture under the "load" split, bit-exact, by us and by megatron-core."""
    cpu_only_megatron()
    from megatron.core import dist_checkpointing

    for version in VERSIONS:
        path = os.path.join(FIXTURES, version)
        ours = ldc.load(build.sharded(ldc, rank, world, "load", with_data=False), path)
        theirs = dist_checkpointing.load(build.sharded(dist_checkpointing.mapping, rank, world, "load",
                                                       with_data=False), path)
        expect = build.sharded(ldc, rank, world, "load")
        for loaded, who in ((ours, "ours"), (theirs, "megatron-core")):
            where = f"{version} {who} rank {rank}"
            for key in ("w", "b", "r"):
                assert loaded[key].dtype == expect[key].data.dtype, where
                assert torch.equal(loaded[key], expect[key].data), f"{where}: {key}"
            assert len(loaded["layers"]) == len(expect["layers"]), where
            assert all(torch.equal(g, w.data) for g, w in zip(loaded["layers"], expect["layers"])), where
            assert loaded["obj"] == {"rank": (rank + 1) % world}, where
            assert {k: loaded[k] for k in build.COMMON} == build.COMMON, where


def test_each_release_loads_under_another_split():
    run_distributed(_load_each, 2, timeout_s=300)


@pytest.mark.parametrize("version", VERSIONS)
def test_each_release_whole_and_through_the_cli(version, capsys):
    from lightning_distckpt.cli.main import main

    path = os.path.join(FIXTURES, version)
    full = build.full()
    plain = ldc.load_plain_tensors(path)
    assert set(plain) == set(full)
    assert all(plain[k].dtype == t.dtype and torch.equal(plain[k], t) for k, t in full.items())
    assert ldc.load_common_state_dict(path) == build.COMMON
    assert main(["inspect", path, "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["format"] == "Megatron-Core torch_dist"
    assert {t["key"]: t["shape"] for t in summary["tensors"]} == {k: list(t.shape) for k, t in full.items()}
    assert [(o["key"], o["elements"]) for o in summary["objects"]] == [("obj", 2)]
    assert main(["validate", path]) == 0
    assert "OK:" in capsys.readouterr().out


def test_reading_runs_no_megatron_code(tmp_path):
    """Reading every release's metadata imports no megatron module (a fresh interpreter), and a
    pickle that calls megatron-core's class name with arguments, or names something beside it,
    is refused without running anything."""
    import pickle
    import subprocess
    import sys

    from lightning_distckpt.core.errors import FormatError
    from lightning_distckpt.reading.formats.dcp_metadata import read_metadata

    code = ("import sys, lightning_distckpt as ldc\n"
            f"for v in {VERSIONS!r}:\n"
            f"    ldc.load_tensors_metadata({FIXTURES!r} + '/' + v)\n"
            "assert not [m for m in sys.modules if m.startswith('megatron')], 'megatron imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)

    canary = tmp_path / "ran"
    mcore = b"megatron.core.dist_checkpointing.strategies.torch"
    called = b"\x80\x02c" + mcore + b"\nMCoreSavePlan\n" + pickle.dumps((str(canary),), protocol=2)[2:-1] + b"R."
    beside = b"\x80\x02cos\nsystem\n" + pickle.dumps((f"touch {canary}",), protocol=2)[2:-1] + b"R."
    for name, blob in (("called", called), ("beside", beside)):
        path = tmp_path / name
        path.write_bytes(blob)
        with pytest.raises(FormatError):
            read_metadata(str(path))
    assert not canary.exists()
