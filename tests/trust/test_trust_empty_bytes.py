"""An empty bytes value (``b""``) round-trips through our checkpoints, and no other use of ``builtins.bytes`` loads.

Found by a fuzz: ``torch.save`` pickles with protocol 2, where ``b""`` is written as a call of ``builtins.bytes``
with no argument (``GLOBAL __builtin__ bytes``, ``EMPTY_TUPLE``, ``REDUCE``; a non-empty value is
``_codecs.encode(str, "latin1")``, which torch's weights-only unpickler allows). ``bytes`` is not on that
unpickler's list, so ``ldc.save`` of a state holding ``b""`` warned at save time and every load refused it
(``UnsafeContentError ... refused to deserialize bytes``): common state, ShardedObjects, the Lightning plugin's
checkpoints (a callback's state), DCP objects torch wrote. Allow-listing ``bytes`` itself would let a hostile
pickle call ``bytes(10**12)`` (a terabyte) or ``bytes(iterable)``.

Now the pickle pre-scan (``storage/pickle_opcodes.py``) lets ``builtins.bytes`` through only as that call (the
global or a memo reference to it, then optionally a memo store, ``EMPTY_TUPLE``, ``REDUCE``), and the loader
gives torch's unpickler a function under the name ``builtins.bytes`` that returns ``b""`` for no argument and
refuses any. Every other use (arguments of any kind, NEWOBJ, INST, STACK_GLOBAL, BUILD on the result, the type
kept as a value, memo and DUP tricks) is an UnsafeContentError, with memory bounded, in a ``torch.save`` zip
archive (a checkpoint's ``common.pt``) and in torch's pre-1.6 stream format. A user who allowed ``bytes``
(``extra_safe_globals=[bytes]``) gets torch's own behaviour, as before.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import pickle
import struct
import tracemalloc
from typing import Any, Callable, Dict

import pytest
import torch
from lightning.pytorch import Callback

import lightning_distckpt as ldc
from lightning_distckpt.storage.layout import COMMIT_MARKER
from trust.hostile import run_bounded
from trust.test_hostile_foreign_structure_fuzz import rewrite_zip_pickle

GB = b"c__builtin__\nbytes\n"  # how protocol 2 names builtins.bytes
EMPTY_CALL = b")R"  # EMPTY_TUPLE REDUCE: bytes()
MEMORY_BOUND = 64 << 20  # what a refused load may allocate at its peak (the hostile calls ask for 8 GiB and 1 TB)


def _long1(value: int) -> bytes:
    raw = value.to_bytes((value.bit_length() + 8) // 8, "little", signed=True)
    return b"\x8a" + bytes([len(raw)]) + raw


def _short(text: str) -> bytes:
    raw = text.encode()
    return b"X" + struct.pack("<I", len(raw)) + raw


#: name -> what replaces the b"" call (``GLOBAL bytes, BINPUT n, EMPTY_TUPLE, REDUCE``) in a real pickle
HOSTILE: Dict[str, bytes] = {
    "eight_gib": GB + _long1(1 << 33) + b"\x85R",  # bytes(2**33): TUPLE1 REDUCE
    "terabyte": GB + _long1(10 ** 12) + b"\x85R",
    "small_int": GB + b"K\x05\x85R",
    "list": GB + b"]K\x01aK\x02a\x85R",  # bytes([1, 2])
    "str": GB + _short("abc") + _short("latin1") + b"\x86R",  # bytes("abc", "latin1")
    "py3_name_with_arg": b"cbuiltins\nbytes\nK\x05\x85R",
    "mark_tuple_arg": GB + b"(K\x05tR",
    "empty_mark_tuple": GB + b"(tR",  # () built otherwise: not the exact form
    "newobj": GB + b"K\x05\x85\x81",
    "newobj_empty": GB + b")\x81",
    "value": GB,  # the type itself, kept as a value
    "args_then_reduce": GB + b")K\x01\x86R",  # EMPTY_TUPLE, then more before the REDUCE: bytes((), 1)
    "dup": GB + b"2" + EMPTY_CALL + b"K\x05\x85R\x86",  # a second reference through DUP, called with 5
    # (b"", bytes(2**33)): the second call through the memo entry the first stored
    "memo_again": GB + b"q\xc8" + EMPTY_CALL + b"h\xc8" + _long1(1 << 33) + b"\x85R\x86",
    "long_memo_again": GB + b"r" + struct.pack("<I", 300) + EMPTY_CALL + b"j" + struct.pack("<I", 300)
                       + b"]K\x01a\x85R\x86",
    "memo_as_value": GB + b"q\xc8" + EMPTY_CALL + b"h\xc8\x86",  # the memo's reference kept as a value
    "build_on_result": GB + EMPTY_CALL + b"}" + _short("a") + b"K\x01sb",  # BUILD fills in b""
    "stack_global": b"\x8c\x08builtins\x8c\x05bytes\x93K\x05\x85R",
    "inst": b"(K\x05i__builtin__\nbytes\n",
}


def _with_call(data: bytes, replacement: bytes) -> bytes:
    """``data`` (a pickle holding one ``b""``) with its call of ``bytes()`` replaced."""
    start = data.index(GB)
    end = data.index(EMPTY_CALL, start) + len(EMPTY_CALL)
    assert end - start <= len(GB) + 5 + len(EMPTY_CALL), data[start:end]
    return data[:start] + replacement + data[end:]


def _rewrite_common(path: str, replacement: bytes) -> None:
    """The checkpoint ``path`` with its common.pt's ``b""`` call replaced, as a writer of hostile checkpoints
    would do it: the archive rewritten by torch's own writer (CRCs match), the commit marker's checksum of it
    recorded again (a checksum, no signature)."""
    common = os.path.join(path, "common.pt")
    rewrite_zip_pickle(common, lambda d: _with_call(d, replacement))
    with open(os.path.join(path, COMMIT_MARKER)) as f:
        marker = json.load(f)
    with open(common, "rb") as f:
        marker["common_sha256"] = hashlib.sha256(f.read()).hexdigest()
    with open(os.path.join(path, COMMIT_MARKER), "w") as f:
        json.dump(marker, f)


def _bounded(load: Callable[[], Any]) -> Dict[str, Any]:
    """``load()``'s value or error, within 60 s and :data:`MEMORY_BOUND` of allocations at the peak."""
    tracemalloc.start()
    try:
        out = run_bounded(load, 60.0)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < MEMORY_BOUND, f"allocated {peak} bytes at the peak"
    return out


def _assert_refused(out: Dict[str, Any], case: str) -> None:
    err = out.get("error")
    assert isinstance(err, ldc.UnsafeContentError), (case, out)
    assert "refused to deserialize" in str(err), (case, str(err))


def _saved(path: str, **common: Any) -> str:
    ldc.save({"w": ldc.ShardedTensor.from_rank_offsets("w", torch.arange(3.0)), **common}, path)
    return path


def test_empty_bytes_round_trips_through_save_load_and_the_common_state(tmp_path):
    """``b""`` in the common state (alone, twice: the second a memo reference, in a list beside non-empty
    bytes) and as a ShardedObject loads back as ``b""`` through ldc.load and load_common_state_dict."""
    path = _saved(str(tmp_path / "c"), x=b"", nested={"a": [b"", b"ab", b""], "t": (b"",)},
                  obj=ldc.ShardedObject("obj", b"", (1,), (0,)))
    common = ldc.load_common_state_dict(path)
    assert common == {"x": b"", "nested": {"a": [b"", b"ab", b""], "t": (b"",)}}, common
    out = ldc.load({"w": ldc.ShardedTensor.from_rank_offsets("w", torch.zeros(3)),
                    "obj": ldc.ShardedObject("obj", None, (1,), (0,))}, path)
    assert out["x"] == b"" and out["obj"] == b"" and out["nested"]["a"] == [b"", b"ab", b""]
    assert torch.equal(out["w"], torch.arange(3.0))


def test_saving_empty_bytes_warns_of_no_refusal(tmp_path, caplog):
    """The save-time check (saving/load_check.py) loads the pickle as a load will: nothing to warn of now."""
    with caplog.at_level(logging.WARNING, logger="lightning_distckpt.saving.load_check"):
        _saved(str(tmp_path / "c"), x=b"", obj=ldc.ShardedObject("obj", [b""], (1,), (0,)))
    said = [r.getMessage() for r in caplog.records if r.name == "lightning_distckpt.saving.load_check"]
    assert said == []


def test_the_exact_forms_load(tmp_path):
    """The call under either module name, its global stored by BINPUT or LONG_BINPUT and called again through
    BINGET and LONG_BINGET (as protocol 2 writes a second ``b""`` of another object), all load as ``b""``."""
    twice = {"x": (b"", b"")}
    forms = {"binput": (GB + b"q\xc8" + EMPTY_CALL + b"h\xc8" + EMPTY_CALL + b"\x86", twice),
             "long_binput": (GB + b"r" + struct.pack("<I", 300) + EMPTY_CALL + b"j" + struct.pack("<I", 300)
                             + EMPTY_CALL + b"\x86", twice),
             "py3_name": (b"cbuiltins\nbytes\n" + EMPTY_CALL, {"x": b""})}
    for name, (form, want) in forms.items():
        path = _saved(str(tmp_path / name), x=b"")
        _rewrite_common(path, form)
        assert ldc.load_common_state_dict(path) == want, name


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_every_other_use_of_bytes_is_refused_in_a_common_pt(tmp_path, case):
    """A checkpoint whose common.pt's ``b""`` call is replaced (records rewritten by torch's own writer) is
    refused by load_common_state_dict and ldc.load with an UnsafeContentError, allocating little."""
    path = _saved(str(tmp_path / "c"), x=b"")
    _rewrite_common(path, HOSTILE[case])
    _assert_refused(_bounded(lambda: ldc.load_common_state_dict(path)), case)
    template = {"w": ldc.ShardedTensor.from_rank_offsets("w", torch.zeros(3))}
    _assert_refused(_bounded(lambda: ldc.load(template, path)), case)


def _legacy_file(path: str, value: Any, replacement: bytes = b"") -> str:
    """``value`` saved in torch's pre-1.6 stream format, its ``b""`` call replaced where ``replacement`` is given."""
    buf = io.BytesIO()
    torch.save(value, buf, _use_new_zipfile_serialization=False)
    data = buf.getvalue()
    with open(path, "wb") as f:
        f.write(_with_call(data, replacement) if replacement else data)
    return path


@pytest.mark.parametrize("case", ["eight_gib", "list", "memo_again", "value", "newobj"])
def test_the_pre_1_6_stream_format_is_held_to_the_same_rule(tmp_path, case):
    """A torch file in the pre-1.6 format (the stream pre-scan, read in windows) loads ``b""`` and refuses the
    hostile forms, as the zip archive does."""
    from lightning_distckpt.storage.safe_pickle import load_file

    good = _legacy_file(str(tmp_path / "good.pt"), {"x": b"", "t": torch.ones(2)})
    back = load_file(good)
    assert back["x"] == b"" and torch.equal(back["t"], torch.ones(2))
    bad = _legacy_file(str(tmp_path / "bad.pt"), {"x": b"", "t": torch.ones(2)}, HOSTILE[case])
    _assert_refused(_bounded(lambda: load_file(bad)), case)


def test_the_stream_scan_follows_the_call_across_a_window_edge():
    """The pre-1.6 stream is scanned a window (64 KiB) at a time: the call and a second call through its memo
    entry, placed at each alignment across the first window's edge, pass when exact and are refused when the
    second has an argument; the stream is left after the pickle's STOP."""
    from lightning_distckpt.storage.pickle_scan import check_pickle

    good = GB + b"q\xc8" + EMPTY_CALL + b"h\xc8" + EMPTY_CALL + b"\x86."
    bad = GB + b"q\xc8" + EMPTY_CALL + b"h\xc8" + b"K\x05\x85R\x86."
    for shift in range(-len(good) - 12, 12):
        pad = (1 << 16) + shift - 8  # PROTO (2 bytes) and BINUNICODE's header (5) before it, POP (1) after
        head = b"\x80\x02X" + struct.pack("<I", pad) + b"p" * pad + b"0"
        f = io.BytesIO(head + good + b"after")
        check_pickle(f, "stream", len(f.getvalue()))
        assert f.tell() == len(head + good), shift
        with pytest.raises(ldc.UnsafeContentError, match="builtins.bytes"):
            check_pickle(io.BytesIO(head + bad + b"after"), "stream", len(head + bad) + 5)


def test_a_user_who_allowed_bytes_gets_torch_behaviour(tmp_path):
    """``extra_safe_globals=[bytes]`` (the remedy the refusal names for a trusted checkpoint) lets the real
    ``bytes`` load: ``bytes([1, 2])`` is ``b"\\x01\\x02"`` then, as torch's unpickler alone gives it."""
    path = _saved(str(tmp_path / "c"), x=b"")
    _rewrite_common(path, HOSTILE["list"])
    refused = _bounded(lambda: ldc.load_common_state_dict(path))
    _assert_refused(refused, "list")
    assert "extra_safe_globals=[bytes]" in str(refused["error"])
    assert ldc.load_common_state_dict(path, extra_safe_globals=[bytes]) == {"x": b"\x01\x02"}


def test_the_allowed_function_refuses_arguments_for_any_torch_load_meanwhile(tmp_path):
    """While a load of ours runs, torch's process-wide allow-list names ``builtins.bytes`` (our function): a
    plain ``torch.load(weights_only=True)`` in another thread, which runs no pre-scan, still cannot call it with
    an argument (bytes(2**33)): UnpicklingError, nothing allocated."""
    from lightning_distckpt.storage.safe_pickle import _EMPTY_BYTES, _allowed

    path = _saved(str(tmp_path / "c"), x=b"")
    common = os.path.join(path, "common.pt")
    rewrite_zip_pickle(common, lambda d: _with_call(d, HOSTILE["eight_gib"]))
    with _allowed([_EMPTY_BYTES]):
        out = _bounded(lambda: torch.load(common, weights_only=True))
        good = io.BytesIO()
        torch.save({"x": b""}, good)
        good.seek(0)
        assert torch.load(good, weights_only=True) == {"x": b""}
    assert isinstance(out.get("error"), pickle.UnpicklingError), out
    assert "only bytes()" in str(out["error"])
    assert _EMPTY_BYTES not in torch.serialization.get_safe_globals()  # taken away again


def test_a_dcp_object_holding_empty_bytes_loads(tmp_path):
    """torch's DCP pickles its objects with torch.save (protocol 2): ``b""`` among them loads through
    load_common_state_dict and ldc.load, without extra_safe_globals."""
    import torch.distributed.checkpoint as dcp

    path = str(tmp_path / "dcp")
    dcp.save({"w": torch.arange(4.0), "o": b"", "l": [b"", b"z"]}, checkpoint_id=path, no_dist=True)
    common = ldc.load_common_state_dict(path)
    assert common["o"] == b"" and common["l"] == [b"", b"z"], common
    out = ldc.load({"w": torch.zeros(4), "o": None}, path)
    assert out["o"] == b"" and torch.equal(out["w"], torch.arange(4.0))


class _BlobState(Callback):
    """A stateful callback whose state holds ``b""`` (and a non-empty value beside it)."""

    def __init__(self) -> None:
        self.state: Dict[str, Any] = {"blob": b"", "more": [b"", b"x"]}
        self.loaded: Any = None

    def state_dict(self) -> Dict[str, Any]:
        return dict(self.state)

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.loaded = state


def test_a_lightning_fit_with_empty_bytes_in_a_callback_state_resumes(tmp_path):
    """A Trainer fit with the DistCheckpointIO plugin saves a callback state holding ``b""``; a second fit
    resumed from that checkpoint gives the callback its state back, ``b""`` included."""
    from lightning.pytorch.demos.boring_classes import BoringModel

    from lightning_distckpt.lightning import DistCheckpointIO
    from lightning_helpers import quiet_trainer

    ckpt = str(tmp_path / "step2.ckpt")
    first = _BlobState()
    trainer = quiet_trainer(plugins=[DistCheckpointIO()], callbacks=[first], max_steps=2,
                            enable_checkpointing=False, default_root_dir=str(tmp_path))
    trainer.fit(BoringModel())
    trainer.save_checkpoint(ckpt)
    assert os.path.isdir(ckpt)  # ours: a checkpoint directory
    second = _BlobState()
    resumed = quiet_trainer(plugins=[DistCheckpointIO()], callbacks=[second], max_steps=3,
                            enable_checkpointing=False, default_root_dir=str(tmp_path))
    resumed.fit(BoringModel(), ckpt_path=ckpt)
    assert second.loaded == {"blob": b"", "more": [b"", b"x"]}, second.loaded
    assert resumed.global_step == 3
