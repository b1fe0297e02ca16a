"""The async snapshot copies each shard into the staging pool exactly (a memcpy of the bytes
where the tensor's value is its bytes in order, torch's copy otherwise), and the copy is its own:
the caller may change its tensors as soon as the snapshot returns."""

import torch

from lightning_distckpt.saving.async_staging import StagingPool, plan_staging
from lightning_distckpt.storage.base import ShardWrite


def _shards():
    return [
        ShardWrite("param", 0, torch.nn.Parameter(torch.randn(3, 4))),  # requires grad
        ShardWrite("transposed", 0, torch.randn(5, 6).t()),  # not contiguous
        ShardWrite("scalar", 0, torch.tensor(3.5, dtype=torch.bfloat16)),
        ShardWrite("conj", 0, torch.randn(4, dtype=torch.complex64).conj()),  # a lazy conjugate bit
        ShardWrite("neg", 0, torch.randn(4, dtype=torch.complex64).conj().imag),  # a lazy negative bit
        ShardWrite("mask", 0, torch.tensor([True, False, True])),
        ShardWrite("empty", 0, torch.empty(0, 3)),
        ShardWrite("offset", 0, torch.arange(10, dtype=torch.int64)[2:7]),  # a view from an offset
        ShardWrite("half", 0, torch.randn(2, 3, 4).to(torch.float16)),
    ]


def test_snapshot_is_an_exact_private_copy():
    shards = _shards()
    want = {w.key: w.data.detach().resolve_conj().resolve_neg().clone() for w in shards}
    plan = plan_staging(shards, None)
    pool = StagingPool()
    pool.prepare(plan)
    staged = pool.stage(plan.staged)
    for w in shards:  # the caller changes its tensors right after
        if w.data.numel() and not w.data.is_conj() and not w.data.is_neg():
            with torch.no_grad():
                w.data.zero_()
    for s in staged:
        assert s.data.dtype == want[s.key].dtype and s.data.shape == want[s.key].shape, s.key
        assert torch.equal(s.data, want[s.key]), s.key
        assert s.data.is_contiguous() and not s.data.requires_grad


def test_snapshot_reuses_the_pool():
    shards = _shards()
    plan = plan_staging(shards, None)
    pool = StagingPool()
    pool.prepare(plan)
    first = {s.key: s.data.data_ptr() for s in pool.stage(plan.staged)}
    pool.prepare(plan)  # the next save of the same layout
    assert {s.key: s.data.data_ptr() for s in pool.stage(plan.staged)} == first


def test_a_changed_layout_is_laid_out_anew_and_copied_exactly():
    """The next save takes the last save's buffers only for the same shards in the same order with the same
    shapes and dtypes: a shard reshaped, retyped, added or reordered gets buffers of its own shape."""
    shards = _shards()
    pool = StagingPool()
    pool.prepare(plan_staging(shards, None))
    pool.stage(plan_staging(shards, None).staged)
    big = max(pool.nbytes, 1 << 16)
    changes = {
        "reshaped": [w._replace(data=torch.randn(4, 3)) if w.key == "param" else w for w in shards],
        "retyped": [w._replace(data=w.data.double()) if w.key == "half" else w for w in shards],
        "reordered": list(reversed(shards)),
        "added": shards + [ShardWrite("new", 0, torch.arange(6.0))],
    }
    for name, changed in changes.items():
        plan = plan_staging(changed, None)
        pool.prepare(plan)
        assert pool.nbytes <= big, name
        staged = pool.stage(plan.staged)
        for s, src in zip(staged, changed):
            want = src.data.detach().resolve_conj().resolve_neg()
            assert s.key == src.key and s.data.shape == want.shape and s.data.dtype == want.dtype, (name, s.key)
            assert torch.equal(s.data, want), (name, s.key)


def test_release_lets_go_of_the_pool():
    """Released, the pool keeps no view of its memory (a kept view would keep the memory)."""
    shards = _shards()
    pool = StagingPool()
    pool.prepare(plan_staging(shards, None))
    pool.stage(plan_staging(shards, None).staged)
    pool.release()
    assert pool.nbytes == 0 and not pool.views and pool._placement is None
