"""``storage.packs.settle``: a read that fails part-way waits for tensorstore's reads already running into the
destinations (a tensor the caller frees or reuses once the load raised must not be written to afterwards)."""

import numpy as np
import tensorstore as ts

from lightning_distckpt.storage.packs import settle


def _array(tmp_path, name, fill=True):
    spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(tmp_path / name)},
            "metadata": {"shape": [256, 256], "data_type": "float32", "chunk_grid": {"name": "regular",
                         "configuration": {"chunk_shape": [64, 256]}}}}
    arr = ts.open(spec, create=True).result()
    if fill:
        arr.write(np.arange(256 * 256, dtype=np.float32).reshape(256, 256)).result()
    return ts.open({**spec, "metadata": {}, "fill_missing_data_reads": False}, open=True).result()


def test_settle_waits_for_every_read_and_swallows_their_errors(tmp_path):
    good, empty = _array(tmp_path, "good"), _array(tmp_path, "empty", fill=False)
    dest = np.zeros((256, 256), np.float32)
    into = ts.array(dest, copy=False, write=True)
    futures = [into.write(good), empty.read()]  # the second fails: its chunks are missing
    settle(futures)
    assert all(f.done() for f in futures)
    assert np.array_equal(dest, np.arange(256 * 256, dtype=np.float32).reshape(256, 256))
    assert futures[1].exception() is not None
