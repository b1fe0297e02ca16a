"""The CRC-32C our chunk checksums use (``crc32c-rs`` where installed) is the ``crc32c`` package's,
the reference that equals the zarr v3 codec's (tests/unit/test_direct_read.py), on every length and
alignment its vector code treats differently, and continued from any value."""

import sys

import crc32c as reference
import numpy as np
from hypothesis import given, settings, strategies as st

from lightning_distckpt.storage import chunk_checksums
from lightning_distckpt.storage.chunk_checksums import crc32c

_DATA = np.random.default_rng(0).integers(0, 256, (4 << 20) + 129, dtype=np.uint8)


def test_python_3_11_and_later_checksum_with_crc32c_rs():
    expected = "crc32c-rs" if sys.version_info >= (3, 11) else "crc32c"
    assert chunk_checksums.CRC_IMPLEMENTATION == expected


def test_every_short_length_at_every_alignment_matches_the_reference():
    for length in range(0, 520):
        for start in (0, 1, 7, 31, 63):
            piece = memoryview(_DATA[start:start + length])
            assert crc32c(piece) == reference.crc32c(piece), (length, start)


@settings(max_examples=200, deadline=None)
@given(start=st.integers(0, 4096), length=st.integers(0, 4 << 20), value=st.integers(0, 2**32 - 1),
       cut=st.floats(0, 1))
def test_long_pieces_continued_from_any_value_match_the_reference(start, length, value, cut):
    piece = memoryview(_DATA[start:start + length])
    split = int(len(piece) * cut)
    assert crc32c(piece, value) == reference.crc32c(piece, value)
    assert crc32c(piece[split:], crc32c(piece[:split], value)) == reference.crc32c(piece, value)


def test_typed_arrays_are_checksummed_as_their_bytes():
    for arr in (np.arange(10, dtype=np.float32), np.ones((3, 5), dtype=np.int64), np.float64(2.5).reshape(())):
        assert crc32c(arr) == reference.crc32c(arr.tobytes())
