"""A load template a load cannot write into, and a FIFO where a save drops its written files from
the page cache (red-team findings).

* A template tensor whose elements share memory (``torch.empty(1, 4).expand(3, 4)``) was a raw
  RuntimeError from torch's copy mid-load; it is a ShardingError naming the key, before anything is
  read, the same on every rank when one rank's template is the odd one.
* ``page_cache.drop`` opens every file a save wrote to drop it from the cache: a FIFO among them
  (put there while the save ran) would have blocked that open for ever; it is skipped.
"""

import os

import pytest
import torch

import lightning_distckpt as ldc
from dist_utils import run_distributed
from lightning_distckpt.core.errors import ShardingError
from lightning_distckpt.storage.page_cache import drop
from trust.hostile import run_bounded


def _saved(path):
    ldc.save({"w": ldc.ShardedTensor.from_rank_offsets("w", torch.arange(12.0).reshape(3, 4))}, str(path))
    return str(path)


@pytest.mark.parametrize("make", [lambda: torch.empty(1, 4).expand(3, 4), lambda: torch.empty(()).expand(3, 4)])
def test_a_template_whose_elements_share_memory_is_a_sharding_error(tmp_path, make):
    path = _saved(tmp_path / "ck")
    with pytest.raises(ShardingError, match="'w' is a tensor whose elements share memory"):
        ldc.load({"w": ldc.ShardedTensor.from_rank_offsets("w", make())}, path)
    # a view that does not overlap itself (transposed) is written in place, exactly
    dest = torch.zeros(4, 3).t()
    out = ldc.load({"w": ldc.ShardedTensor.from_rank_offsets("w", dest)}, path)
    assert torch.equal(out["w"], torch.arange(12.0).reshape(3, 4)) and out["w"].data_ptr() == dest.data_ptr()


def _one_odd_template(rank, world, path):
    rows = torch.zeros(()).expand(1, 4) if rank == 0 else torch.zeros(1, 4)  # rank 0: one element for four
    w = ldc.ShardedTensor.from_rank_offsets("w", rows, (0, rank, world))
    try:
        ldc.load({"w": w}, path)
    except ShardingError as e:
        return str(e)
    return None


def test_one_ranks_odd_template_is_the_same_error_on_every_rank(tmp_path):
    path = str(tmp_path / "ck")
    ldc.save({"w": ldc.ShardedTensor.from_rank_offsets("w", torch.arange(8.0).reshape(2, 4))}, path)
    errors = run_distributed(_one_odd_template, 2, path)
    assert errors[0] is not None and errors[0] == errors[1] and "rank 0" in errors[0], errors


@pytest.mark.skipif(not hasattr(os, "mkfifo") or not hasattr(os, "posix_fadvise"), reason="Linux's")
def test_dropping_written_files_skips_a_fifo(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "data").write_bytes(b"x" * 8192)
    os.mkfifo(tmp_path / "d" / "fifo")
    paths = [str(tmp_path / "d" / name) for name in ("data", "fifo")]
    out = run_bounded(lambda: drop(paths), 30,
                      on_timeout=lambda: os.close(os.open(tmp_path / "d" / "fifo", os.O_WRONLY | os.O_NONBLOCK)))
    assert out == {"value": 1}  # the regular file only
