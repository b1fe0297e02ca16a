"""Fuzzing what a load trusts (hypothesis): random byte flips, truncations and deletions of a
checkpoint's files (data files, objects, common.pt, metadata.json, the commit marker) and random
values in metadata.json's fields. Every outcome is exactly the saved data or a CheckpointingError:
never another exception type, a crash or, for damaged bytes, wrong values.

Bounded for CI (a few seconds). ``LDC_FUZZ_EXAMPLES=2000 pytest tests/unit/test_fuzz.py -s`` runs longer
and prints how many cases each test tried.
"""

import json
import os
import shutil
import tempfile

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import lightning_distckpt as ldc
from lightning_distckpt import validate
from lightning_distckpt.storage.checksums import sha256_hex

EXAMPLES = int(os.environ.get("LDC_FUZZ_EXAMPLES", "40"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize="LDC_FUZZ_EXAMPLES" not in os.environ,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
W = torch.arange(40 * 100, dtype=torch.float32).reshape(40, 100)  # 16 KiB: 4 chunks of 4 KiB
NORM = torch.linspace(-1, 1, 50).to(torch.bfloat16)  # packed
TRIED = {}


def _state():
    return {"w": ldc.ShardedTensor.from_rank_offsets("w", W.clone()),
            "norm": ldc.ShardedTensor.from_rank_offsets("norm", NORM.clone()),
            "o": ldc.ShardedObject("o", {"seed": 1234, "tag": "x" * 100}, (1,), (0,)),
            "step": 17, "hparams": {"lr": 0.5}}


def _load(ck):
    out = ldc.load({"w": ldc.ShardedTensor.from_rank_offsets("w", torch.zeros(40, 100)),
                    "norm": ldc.ShardedTensor.from_rank_offsets("norm", torch.zeros(50, dtype=torch.bfloat16)),
                    "o": ldc.ShardedObject("o", None, (1,), (0,))}, ck)
    return out


def _exact(out):
    return (torch.equal(out["w"], W) and torch.equal(out["norm"], NORM) and out["o"] == {"seed": 1234, "tag": "x" * 100}
            and out["step"] == 17 and out["hparams"] == {"lr": 0.5})


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    out = {}
    for layout in ("ocdbt", "zarr"):
        out[layout] = str(root / layout)
        opts = ldc.StorageOptions(layout=layout, chunk_bytes=4096, pack_max_bytes=1024)
        ldc.save(_state(), out[layout], storage=opts)
        assert _exact(_load(out[layout]))
    return out


def _files(ck):
    return sorted(os.path.relpath(os.path.join(d, f), ck) for d, _, fs in os.walk(ck) for f in fs)


class Scratch:
    """A fresh copy of a saved checkpoint per example (hypothesis runs many in one test call)."""

    def __init__(self, src):
        self.dir = tempfile.mkdtemp(prefix="fuzz-")
        self.ck = os.path.join(self.dir, "ck")
        shutil.copytree(src, self.ck)

    def __enter__(self):
        return self.ck

    def __exit__(self, *exc):
        shutil.rmtree(self.dir, ignore_errors=True)


def _count(name):
    TRIED[name] = TRIED.get(name, 0) + 1


def _outcome(ck, exact_required):
    """Load and validate: exactly the saved data, or CheckpointingError; anything else fails the test."""
    try:
        out = _load(ck)
    except ldc.CheckpointingError:
        loaded = False
    else:
        loaded = True
        if exact_required:
            assert _exact(out), "damaged bytes loaded as wrong values"
    try:
        report = validate(ck)
    except ldc.CheckpointingError:
        return
    if exact_required and report.ok:
        assert loaded, f"validate says OK but the load failed: {report.problems}"


damage = st.tuples(st.sampled_from(["flip", "truncate", "delete"]), st.integers(0, 1 << 30), st.integers(1, 255))


@FUZZ
@given(layout=st.sampled_from(["ocdbt", "zarr"]), file_pick=st.integers(0, 1 << 30), how=damage)
def test_damaged_files_load_exactly_or_raise(saved, layout, file_pick, how):
    _count("damaged files")
    with Scratch(saved[layout]) as ck:
        files = _files(ck)
        path = os.path.join(ck, files[file_pick % len(files)])
        kind, pos, mask = how
        data = bytearray(open(path, "rb").read())
        if kind == "delete":
            os.remove(path)
        elif kind == "truncate":
            os.truncate(path, pos % max(1, len(data)))
        elif data:
            data[pos % len(data)] ^= mask
            open(path, "wb").write(bytes(data))
        _outcome(ck, exact_required=True)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 70), 1 << 70) | st.floats(allow_nan=True) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=8)


def _paths(node, prefix=()):
    """Every path to a value in a JSON tree."""
    yield prefix
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for k, v in items:
        yield from _paths(v, prefix + (k,))


@FUZZ
@given(layout=st.sampled_from(["ocdbt", "zarr"]), pick=st.integers(0, 1 << 30), value=json_values,
       delete=st.booleans(), rehash=st.booleans())
def test_mutated_metadata_fields_are_checked(saved, layout, pick, value, delete, rehash):
    """A field given any value (or removed). With the marker's hash left alone that is damage and must
    be refused; with the hash recomputed (a buggy or hostile writer) the metadata is authoritative,
    so the values read may differ, but every failure is still a CheckpointingError."""
    _count("metadata fields")
    with Scratch(saved[layout]) as ck:
        meta_path = os.path.join(ck, "metadata.json")
        meta = json.load(open(meta_path))
        paths = [p for p in _paths(meta) if p]
        path = paths[pick % len(paths)]
        node = meta
        for k in path[:-1]:
            node = node[k]
        if delete and isinstance(node, dict):
            del node[path[-1]]
        else:
            node[path[-1]] = value
        raw = json.dumps(meta).encode()
        open(meta_path, "wb").write(raw)
        if rehash:
            marker = json.load(open(os.path.join(ck, "COMMITTED")))
            marker["metadata_sha256"] = sha256_hex(raw)
            json.dump(marker, open(os.path.join(ck, "COMMITTED"), "w"))
        _outcome(ck, exact_required=not rehash)


@pytest.fixture(scope="module", autouse=True)
def _report_cases_tried():
    """Prints how many cases this module's fuzz tests tried, once they have run (see it with -s)."""
    yield
    print(f"\nfuzz cases tried: {TRIED}")
