"""Tensors in ``torch.save`` and ``.safetensors`` files that would cost far more than the file
stores, or that hold no dense data, are FormatErrors naming the file and the tensor, raised when
the file is opened (before anything is allocated), through every reader: ``load_tensors_metadata``,
``load_plain_tensors``, ``load`` and the rank-0 ``load_state_dict``; legitimate files still load
and convert exactly.

* One storage under many names (the same tensor, or full views of it): each name is copied out
  whole, so 2,000 names of a 1 MiB tensor (a 1 MB file) would be 2 GiB; refused. Tied weights,
  slices and views of a flat buffer still load exactly.
* Meta tensors (a shape, no data: 2**40 elements in a few hundred bytes), sparse and nested tensors.
* Zero-element tensors whose dims multiply past 2**63 bytes (``[0, 2**63]``): torch and numpy
  cannot allocate them; zero-element tensors of ordinary shapes still load.

Every refusal is checked first where nothing is allocated (``load_tensors_metadata``), so that a
regression fails the test instead of allocating what the file claims.
"""

import contextlib
import io
import json
import os
import struct

import pytest
import torch
from safetensors.torch import save_file

import lightning_distckpt as ldc
from lightning_distckpt.core.errors import FormatError
from lightning_distckpt.ingest import load_state_dict


def _refused_everywhere(path, *needles):
    """Every reader refuses ``path`` with a FormatError naming the file and ``needles``."""
    with pytest.raises(FormatError) as meta:  # first: this one never allocates tensor data
        ldc.load_tensors_metadata(path)
    assert str(path) in str(meta.value) and all(n in str(meta.value) for n in needles), meta.value
    with pytest.raises(FormatError) as plain:
        ldc.load_plain_tensors(path)
    assert str(plain.value) == str(meta.value)
    template = {"w": ldc.ShardedTensor.from_rank_offsets("w", torch.zeros(4))}
    with pytest.raises(FormatError, match="rank 0: ") as loaded:
        ldc.load(template, path)
    assert str(meta.value) in str(loaded.value)
    return str(meta.value)


def _convert(path, out):
    """``convert path out`` run by the console script's ``main()`` here: its exit status and stderr."""
    from lightning_distckpt.cli.main import main

    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        code = main(["convert", str(path), str(out)])
    return code, err.getvalue()


@pytest.mark.parametrize("mode", ["same", "views"])
def test_one_storage_under_thousands_of_names_is_refused(tmp_path, mode):
    t = torch.ones(256, 1024)  # 1 MiB
    path = tmp_path / f"shared_{mode}.pt"
    torch.save({f"k{i}": t if mode == "same" else t[:, :] for i in range(2000)}, path)
    assert os.path.getsize(path) < 2 << 20  # 2 GiB claimed by a file under 2 MB
    message = _refused_everywhere(path, "1048576 bytes", "1999 other names", "'k0'",
                                  f"together they claim {2000 << 20} bytes")
    assert "past the 1073741824 bytes" in message
    with pytest.raises(FormatError, match="1999 other names"):
        load_state_dict(path)


def test_tied_weights_slices_and_flat_buffer_views_still_load_exactly(tmp_path):
    emb = torch.arange(64 * 32, dtype=torch.float32).reshape(64, 32)
    flat = torch.arange(1000, dtype=torch.float32)  # a flat buffer and each parameter a view of it
    params = {"p0": flat[:600].view(20, 30), "p1": flat[600:1000].view(4, 100)}
    shared = torch.arange(1024, dtype=torch.float32)
    payload = {"embed.weight": emb, "lm_head.weight": emb, "flat": flat, **params,
               "head_rows": emb[:8], "cols": emb[:, 3], "pos": torch.arange(16).expand(2, 16),
               **{f"copy{i}": shared for i in range(100)}}  # 100 names of 4 KiB: well within the budget
    path = tmp_path / "tied.pt"
    torch.save(payload, path)
    meta = ldc.load_tensors_metadata(path)
    assert {k: tuple(v.global_shape) for k, v in meta.items()} == {k: tuple(v.shape) for k, v in payload.items()}
    loaded = ldc.load_plain_tensors(path)
    assert set(loaded) == set(payload)
    assert all(torch.equal(loaded[k], v) and loaded[k].dtype == v.dtype for k, v in payload.items())
    state = load_state_dict(path)  # the rank-0 API: views of the memory map, as saved
    assert all(torch.equal(state[k], v) for k, v in payload.items())
    code, err = _convert(path, tmp_path / "ck")
    assert code == 0, err
    back = ldc.load_plain_tensors(tmp_path / "ck")
    assert all(torch.equal(back[k], v) for k, v in payload.items())


def test_meta_tensors_are_refused_with_key_and_file(tmp_path):
    huge = tmp_path / "meta.pt"
    torch.save({"w": torch.empty(2**40, device="meta")}, huge)  # 4 TiB claimed, a few hundred bytes stored
    assert "'w'" in _refused_everywhere(huge, "meta device", "1099511627776")
    small = tmp_path / "meta_small.pt"
    torch.save({"w": torch.empty(8, device="meta"), "b": torch.ones(2)}, small)
    _refused_everywhere(small, "tensor 'w'", "meta device")
    with pytest.raises(FormatError, match="tensor 'w' of shape \\(8,\\) is on the meta device"):
        load_state_dict(small)  # no longer handed back as if it held data


def _sparse_kinds():
    coo = torch.sparse_coo_tensor(torch.tensor([[0, 1]]), torch.tensor([1.0, 2.0]), (2**40,))
    return {"sparse_coo": coo, "sparse_csr": torch.eye(3).to_sparse_csr(),
            "nested": torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])}


@pytest.mark.parametrize("kind", ["sparse_coo", "sparse_csr", "nested"])
def test_sparse_and_nested_tensors_are_refused_with_key_and_file(tmp_path, kind):
    path = tmp_path / f"{kind}.pt"
    torch.save({"ok": torch.ones(2), "state_dict": {"w": _sparse_kinds()[kind]}}, path)
    message = _refused_everywhere(path, "tensor 'state_dict/w'", f"is a {kind} tensor", "dense")
    assert "NotImplementedError" not in message
    with pytest.raises(FormatError, match=f"is a {kind} tensor"):
        load_state_dict(path)


def _safetensors(path, name, dtype, shape):
    """A safetensors file holding one zero-element tensor of ``shape`` (no bytes), header written here."""
    header = json.dumps({name: {"dtype": dtype, "shape": shape, "data_offsets": [0, 0]}}).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)


@pytest.mark.parametrize("shape", [[0, 2**63], [0, 2**62, 2**62], [2**64, 0], [0] + [2**8] * 8])
def test_zero_element_tensors_past_2_63_are_refused(tmp_path, shape):
    path = tmp_path / "zero.safetensors"
    _safetensors(path, "w", "F32", shape)
    _refused_everywhere(path, "tensor 'w'", "too large", "2**63")
    with pytest.raises(FormatError, match="too large"):
        load_state_dict(path)


def test_zero_element_tensors_past_2_63_bytes_are_refused_from_real_files(tmp_path):
    st = tmp_path / "zero.safetensors"
    save_file({"w": torch.empty(0, 2**62), "ok": torch.ones(2)}, st)  # 2**62 float32: 2**64 bytes per row
    _refused_everywhere(st, "tensor 'w'", "too large", "4 bytes per element")
    pt = tmp_path / "zero.pt"
    torch.save({"w": torch.empty(0).as_strided((0, 2**62, 2**62), (1, 1, 1)), "ok": torch.ones(2)}, pt)
    _refused_everywhere(pt, "tensor 'w'", "too large")


def test_zero_element_tensors_of_ordinary_shapes_still_load(tmp_path):
    tensors = {"a": torch.empty(0, 2**40), "b": torch.empty(5, 0), "c": torch.empty(0), "d": torch.ones(3)}
    st, pt = tmp_path / "z.safetensors", tmp_path / "z.pt"
    save_file(tensors, st)
    torch.save(tensors, pt)
    for path in (st, pt):
        loaded = ldc.load_plain_tensors(path)
        assert {k: tuple(v.shape) for k, v in loaded.items()} == {k: tuple(v.shape) for k, v in tensors.items()}
        assert torch.equal(loaded["d"], torch.ones(3))


@pytest.mark.parametrize("case", ["meta", "expand", "names", "zero_huge"])
def test_convert_and_the_plugin_refuse_what_every_reader_refuses(tmp_path, case):
    """``convert X.pt OUT`` (export.from_torch_file) and ``DistCheckpointIO.load_checkpoint`` of a
    stock file read the payload themselves: the same checks, exit status 2, nothing written."""
    t = torch.ones(256, 1024)
    payload = {"meta": lambda: {"w": torch.empty(2**40, device="meta")},
               "expand": lambda: {"w": torch.zeros(1).expand(10**12)},
               "names": lambda: {f"k{i}": t for i in range(2000)},
               "zero_huge": lambda: {"w": torch.empty(0).as_strided((0, 2**62, 2**62), (1, 1, 1))}}[case]()
    path = tmp_path / "x.pt"
    torch.save(payload, path)
    out = tmp_path / "out"
    code, err = _convert(path, out)
    assert code == 2 and str(path) in err and "Traceback" not in err, err
    assert not out.exists()
    from lightning_distckpt.lightning import DistCheckpointIO

    with pytest.raises(FormatError, match=str(path)):
        DistCheckpointIO().load_checkpoint(str(path))
