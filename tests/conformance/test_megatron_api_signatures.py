"""Where we take Megatron-Core's ``dist_checkpointing`` names, we take its signatures: each shared
function's and class's parameters (names, order, defaults, keyword-only-ness) and methods against the
installed megatron-core's own (``inspect.signature``), and the common cases side by side: the same
``ShardedTensor`` / ``ShardedObject`` built and transformed by both, and Megatron-LM's own calls of
``save`` / ``load`` (a strategy passed positionally, ``async_sharded_save``, ``content_metadata``,
``preprocess_common_before_consistancy_check``) run by ours, single process. The deliberate
differences are docs/interop.md's rows, listed here as ``DIFFERENT``."""

from __future__ import annotations

import inspect

import pytest
import torch

import lightning_distckpt as ldc
from lightning_distckpt.core.errors import ArgumentError, ArgumentTypeError, ShardingError

mdc = pytest.importorskip("megatron.core.dist_checkpointing")
from megatron.core.dist_checkpointing import mapping as mmap  # noqa: E402
from megatron.core.dist_checkpointing import serialization as mser  # noqa: E402
from megatron.core.dist_checkpointing.validation import StrictHandling as MStrict  # noqa: E402

FUNCTIONS = ("save", "load", "load_common_state_dict", "load_tensors_metadata", "load_sharded_metadata",
             "load_plain_tensors", "load_content_metadata", "remove_sharded_tensors")
CLASSES = ("ShardedTensor", "ShardedObject", "ShardedTensorFactory", "LocalNonpersistentObject")
# (name, Megatron-Core's parameter): keyword-only in ours (docs/interop.md: after the strategies, every
# argument of ours is keyword-only; Megatron-LM and NeMo pass these by name)
KEYWORD_ONLY_HERE = {("save", p) for p in ("validate_access_integrity", "async_sharded_save",
                                           "preprocess_common_before_consistancy_check", "content_metadata")} | {
    ("load", p) for p in ("validate_access_integrity", "strict")}
# Megatron-Core's names we do not have (docs/interop.md's table says why)
DIFFERENT: set = set()
# (name, parameter): our default, where it differs from Megatron-Core's (a row of docs/interop.md's table):
# load's integrity check of the templates runs when asked for (True), not by default
DEFAULT_HERE = {("load", "validate_access_integrity"): None}


def _params(fn):
    return list(inspect.signature(fn).parameters.values())


def _default(p):
    return p.default.value if hasattr(p.default, "value") else p.default  # an enum member by its value


@pytest.mark.parametrize("name", FUNCTIONS)
def test_function_takes_megatron_parameters_in_order(name):
    theirs, ours = _params(getattr(mser, name)), {p.name: p for p in _params(getattr(ldc, name))}
    order = list(ours)
    for i, p in enumerate(theirs):
        assert p.name in ours, f"{name}: Megatron-Core's parameter {p.name!r} is missing"
        q = ours[p.name]
        want = DEFAULT_HERE.get((name, p.name), _default(p))
        assert _default(q) == want, f"{name}({p.name}): default {q.default!r} != {want!r}"
        if p.kind is p.KEYWORD_ONLY or (name, p.name) in KEYWORD_ONLY_HERE:
            assert q.kind is q.KEYWORD_ONLY, f"{name}({p.name}) should be keyword-only"
        else:  # positional in theirs: the same position in ours
            assert q.kind is q.POSITIONAL_OR_KEYWORD and order.index(p.name) == i, f"{name}({p.name}) at {i}"
    # our own extra parameters never take a position Megatron-Core's callers could fill
    extra = [q for q in ours.values() if q.name not in {p.name for p in theirs}]
    assert all(q.kind is q.KEYWORD_ONLY or q.default is not q.empty for q in extra)


def test_missing_names_are_the_documented_ones():
    shared = {n for n in dir(mdc) if not n.startswith("_") and callable(getattr(mdc, n))
              and not inspect.isclass(getattr(mdc, n))}
    assert shared - set(dir(ldc)) == DIFFERENT
    with open(__file__.split("tests")[0] + "docs/interop.md") as f:
        doc = f.read()
    assert all(f"| Megatron-Core | `{n}" in doc for n in DIFFERENT)  # a row of the table each
    assert all(f"| Megatron-Core | `{n}(..., {p}=" in doc for n, p in DEFAULT_HERE)


@pytest.mark.parametrize("name", CLASSES)
def test_class_fields_and_methods(name):
    theirs, ours = getattr(mmap, name), getattr(ldc, name)
    t_params, o_params = _params(theirs), _params(ours)
    assert [p.name for p in t_params] == [p.name for p in o_params]
    for p, q in zip(t_params, o_params):
        assert p.default is p.empty or _default(q) == _default(p), f"{name}.{p.name}"
    for attr in (a for a in dir(theirs) if not a.startswith("_")):
        assert hasattr(ours, attr), f"{name}.{attr} is missing"
        t, o = inspect.getattr_static(theirs, attr), inspect.getattr_static(ours, attr)
        assert isinstance(o, property) == isinstance(t, property), f"{name}.{attr}: property in one only"
        if callable(getattr(theirs, attr)) and not isinstance(t, property):
            _same_method_parameters(f"{name}.{attr}", getattr(theirs, attr), getattr(ours, attr))


def _same_method_parameters(what, theirs, ours):
    """Positional parameters in the same order; keyword-only ones (after ``*rank_offsets``) by name;
    Megatron-Core's ``**init_kwargs`` are the constructor's fields, which ours names one by one."""
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.VAR_POSITIONAL)
    t, o = _params(theirs), _params(ours)
    t_pos, o_pos = [p.name for p in t if p.kind in kinds], [p.name for p in o if p.kind in kinds]
    assert o_pos[:len(t_pos)] == t_pos, what
    o_kw = {p.name for p in o if p.kind is p.KEYWORD_ONLY}
    assert {p.name for p in t if p.kind is p.KEYWORD_ONLY} <= o_kw, what


def test_strict_handling_members():
    assert [(m.name, m.value) for m in MStrict] == [(m.name, m.value) for m in ldc.StrictHandling]
    assert all(ldc.StrictHandling.parse(m) is ldc.StrictHandling[m.name] for m in MStrict)


def _both(build):
    """The same construction with Megatron-Core's classes and ours."""
    return build(mmap), build(ldc)


def _fields(st):
    return (st.key, st.dtype, tuple(st.local_shape), st.global_shape, st.global_offset, st.axis_fragmentations,
            st.replica_id, st.prepend_axis_num, st.allow_shape_mismatch, st.flattened_range)


def test_sharded_tensor_methods_agree():
    data = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    theirs, ours = _both(lambda m: m.ShardedTensor.from_rank_offsets(
        "w", data, (0, 1, 2), (2, 1, 3), replica_id=(0, 1), prepend_axis_num=1, allow_shape_mismatch=True))
    assert _fields(theirs) == _fields(ours)
    for method in ("global_slice", "local_chunk_offset_in_global", "max_allowed_chunks"):
        assert getattr(theirs, method)() == getattr(ours, method)(), method
    assert theirs.has_regular_grid == ours.has_regular_grid is True
    assert ours.validate_metadata_integrity() is None
    t_narrow, o_narrow = theirs.narrow(1, 2, 3), ours.narrow(1, 2, 3)
    assert len(t_narrow) == len(o_narrow) == 1 and type(o_narrow[0]) is ldc.ShardedTensor
    assert _fields(t_narrow[0]) == _fields(o_narrow[0]) and torch.equal(t_narrow[0].data, o_narrow[0].data)
    t_empty, o_empty = theirs.without_data(), ours.without_data()
    assert o_empty.data is None and ours.data is data and _fields(t_empty) == _fields(o_empty)
    t_empty.init_data("cpu", torch.zeros)
    o_empty.init_data("cpu", torch.zeros)
    assert torch.equal(t_empty.data, o_empty.data) and o_empty.data.dtype == torch.float32
    o_empty.init_data("cpu", torch.ones)  # data present: unchanged, as theirs
    assert not o_empty.data.any()
    uneven = ldc.ShardedTensor.from_offsets("u", torch.zeros(3), (7,), (2,))
    assert uneven.has_regular_grid is False
    with pytest.raises(ShardingError, match="'u'"):
        uneven.local_chunk_offset_in_global()


def test_sharded_object_methods_agree():
    theirs, ours = _both(lambda m: m.ShardedObject("rng", {"a": 1}, (2, 4), (1, 3), replica_id=1))
    assert ours.unique_key == theirs.unique_key == "rng/shard_1.3_2.4"
    back_t = mmap.ShardedObject.empty_from_unique_key(theirs.unique_key, replica_id=2)
    back_o = ldc.ShardedObject.empty_from_unique_key(ours.unique_key, replica_id=2)
    assert type(back_o) is ldc.ShardedObject
    assert (back_t.key, back_t.data, back_t.global_shape, back_t.global_offset, back_t.replica_id) == (
        back_o.key, back_o.data, back_o.global_shape, back_o.global_offset, back_o.replica_id)
    assert ours.without_data().data is None and ours.data == {"a": 1}
    with pytest.raises(ShardingError, match="not a ShardedObject unique key"):
        ldc.ShardedObject.empty_from_unique_key("rng")
    factory = ldc.ShardedTensorFactory("f", torch.zeros(2), lambda *a: {}, lambda d: d)
    assert factory.without_data().data is None and factory.validate_metadata_integrity() is None


def _state(value: float):
    return {"w": ldc.ShardedTensor.from_rank_offsets("w", torch.full((4,), value)), "step": 3}


def test_megatron_style_save_and_load(tmp_path):
    """Megatron-LM's calls as they are (checkpointing.py): the strategy positionally, its keywords."""
    path = str(tmp_path / "ckpt")
    strategy = mser.get_default_save_sharded_strategy()
    state = _state(1.0)
    assert ldc.save(state, path, strategy, async_sharded_save=False, validate_access_integrity=True,
                    preprocess_common_before_consistancy_check=lambda common: common,
                    content_metadata={"distrib_optim_sharding_type": "fully_sharded"}) is None
    assert "content_metadata" not in state  # the caller's dict is left as it was
    assert ldc.load_content_metadata(path) == {"distrib_optim_sharding_type": "fully_sharded"}
    common = ldc.load_common_state_dict(path)
    assert mser.load_content_metadata(preloaded_state_dict=common) == ldc.load_content_metadata(
        preloaded_state_dict=common)
    loaded = ldc.load(_state(0.0), path, ("torch_dist", 1), None, validate_access_integrity=False,
                      strict="assume_ok_unexpected")
    assert torch.equal(loaded["w"], torch.ones(4)) and loaded["step"] == 3
    assert set(ldc.load_tensors_metadata(path, None)) == {"w"}
    assert set(ldc.load_sharded_metadata(path, None, None)) == {"w"}
    ldc.save(_state(2.0), str(tmp_path / "plain"))  # no content metadata: None, as theirs
    assert ldc.load_content_metadata(str(tmp_path / "plain")) is None


def test_async_sharded_save_is_async_save(tmp_path):
    path = str(tmp_path / "ckpt")
    request = ldc.save(_state(5.0), path, async_sharded_save=True)
    assert request is not None
    request.finalize()
    assert torch.equal(ldc.load_plain_tensors(path)["w"], torch.full((4,), 5.0))


def test_megatron_arguments_of_the_wrong_type_are_named(tmp_path):
    path = str(tmp_path / "ckpt")
    with pytest.raises(ArgumentTypeError, match="sharded_strategy"):
        ldc.save(_state(1.0), path, "torch_dist")  # not a (backend, version) tuple
    with pytest.raises(ArgumentTypeError, match="content_metadata"):
        ldc.save(_state(1.0), path, content_metadata=["x"])
    with pytest.raises(ArgumentTypeError, match="async_sharded_save"):
        ldc.save(_state(1.0), path, async_sharded_save="yes")
    with pytest.raises(ArgumentTypeError, match="preprocess_common_before_consistancy_check"):
        ldc.save(_state(1.0), path, preprocess_common_before_consistancy_check=1)
    with pytest.raises(ArgumentTypeError, match="common_strategy"):
        ldc.load(_state(1.0), path, None, 3)
    with pytest.raises(ArgumentTypeError, match="validate_access_integrity"):
        ldc.load(_state(1.0), path, validate_access_integrity="yes")
    with pytest.raises(ArgumentError, match="checkpoint_dir or preloaded_state_dict"):
        ldc.load_content_metadata()
