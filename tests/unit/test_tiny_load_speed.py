"""Contracts of the helpers that keep a load of many tiny tensors cheap (issue 29); never timed.

``reading/buckets.py`` moves a bucket's bytes by a raw memmove where a tensor's memory is plainly its
values and exactly the chunk's size, and otherwise as before (numpy, torch): the result must be the
same bytes either way, and nothing may be moved raw that is not safe to move so.
"""

from __future__ import annotations

import torch

from lightning_distckpt.core.tensor_bytes import byte_view
from lightning_distckpt.reading.buckets import gather_bytes, raw_addresses, scatter_bytes


def _mixed() -> list:
    """Contiguous tensors (a bucket's reader gathers from its read targets, always contiguous) of several
    dtypes: one at a storage offset, one element with an odd stride, bfloat16, bool, complex, empty."""
    odd = torch.arange(10, dtype=torch.int16)[::2][:1].reshape(1)  # one element: contiguous by torch's rule
    return [torch.arange(5, dtype=torch.float32), torch.arange(30.0)[6:30], odd,
            torch.tensor([1.5, -2.0], dtype=torch.bfloat16), torch.tensor([True, False, True]),
            torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64), torch.empty(0), torch.arange(3, dtype=torch.int64)]


def _sizes(ts: list) -> list:
    return [t.numel() * t.element_size() for t in ts]


def test_gather_then_scatter_round_trips_every_kind() -> None:
    src = _mixed()
    sizes = _sizes(src)
    buf = torch.zeros(sum(sizes), dtype=torch.uint8)
    gather_bytes(buf, src, sizes)
    want = torch.cat([byte_view(t.contiguous()) for t in src])
    assert torch.equal(buf, want)
    dst = [torch.zeros_like(t) for t in src]
    # and below a non-contiguous destination: torch's path
    scatter_bytes(buf, dst, sizes)
    for a, b in zip(src, dst):
        assert torch.equal(a, b)
    strided = torch.zeros(24, 2)[:, 0]
    scatter_bytes(buf[sizes[0]:sizes[0] + sizes[1]], [strided], [sizes[1]])
    assert torch.equal(strided, src[1])


def test_raw_only_where_memory_is_the_values() -> None:
    z = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    ts = [torch.arange(4.0), torch.arange(8.0)[::2], z.conj(), z.imag._neg_view(),
          torch.arange(4.0), torch.empty(0)]
    sizes = [16, 16, 16, 8, 12, 0]  # the fifth claims fewer bytes than it has: not raw
    buf = torch.zeros(sum(sizes), dtype=torch.uint8)
    got = raw_addresses(buf, ts, sizes)
    assert got[0] == ts[0].data_ptr()
    assert got[1:] == [0, 0, 0, 0, 0]


def test_no_raw_move_into_a_short_or_strange_buffer() -> None:
    ts = [torch.arange(4.0)]
    assert raw_addresses(torch.zeros(15, dtype=torch.uint8), ts, [16]) == [0]  # shorter than the chunks
    assert raw_addresses(torch.zeros(16, dtype=torch.int8), ts, [16]) == [0]
    assert raw_addresses(torch.zeros(32, dtype=torch.uint8)[::2], ts, [16]) == [0]
    assert raw_addresses(torch.zeros(16, dtype=torch.uint8), ts, [16]) == [ts[0].data_ptr()]


def test_raw_scatter_into_an_offset_view_writes_only_its_bytes() -> None:
    """A destination that is a view into a larger tensor (a storage offset) gets its bytes and no others."""
    big = torch.zeros(10)
    d = big[3:6]
    buf = torch.arange(3.0).add(7).view(torch.uint8).clone()
    scatter_bytes(buf, [d], [12])
    assert big.tolist() == [0, 0, 0, 7, 8, 9, 0, 0, 0, 0]


def test_destination_stays_resizable() -> None:
    """A load must not leave the user's tensors unresizable (as Tensor.numpy() would)."""
    d = torch.zeros(4)
    scatter_bytes(torch.arange(4.0).view(torch.uint8).clone(), [d], [16])
    d.resize_(8)
    assert d[:4].tolist() == [0.0, 1.0, 2.0, 3.0]
