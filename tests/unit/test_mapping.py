"""The data model checks its own consistency at construction, naming the key."""

import pytest
import torch

from lightning_distckpt import ShardedObject, ShardedTensor, ShardedTensorFactory, ShardingError


def test_from_rank_offsets_places_shard():
    st = ShardedTensor.from_rank_offsets("w", torch.zeros(4, 6), (0, 1, 2), (1, 2, 3))
    assert st.global_shape == (8, 18)
    assert st.global_offset == (4, 12)
    assert st.axis_fragmentations == (2, 3)
    assert st.is_main_replica


def test_prepend_axis():
    st = ShardedTensor.from_rank_offsets("layers.w", torch.zeros(4, 6), (0, 3, 5), prepend_axis_num=1)
    assert st.global_shape == (5, 4, 6)
    assert st.global_offset == (3, 0, 0)
    assert st.shard_shape == (1, 4, 6)


@pytest.mark.parametrize(
    "build, fragment",
    [
        (lambda: ShardedTensor.from_rank_offsets("bad.key", torch.zeros(4), (0, 2, 2)), "rank 2 is not in [0, 2)"),
        (lambda: ShardedTensor.from_rank_offsets("bad.key", torch.zeros(4), (1, 0, 2)), "axis 1 out of range"),
        (lambda: ShardedTensor.from_rank_offsets("bad.key", torch.zeros(4), (0, 0, 2), (0, 1, 2)), "appears twice"),
        (lambda: ShardedTensor.from_offsets("bad.key", torch.zeros(4), (6,), (3,)), "outside the global size 6"),
        (lambda: ShardedTensor.from_offsets("bad.key", torch.zeros(4, 2), (6,), (0,)), "must have 2 axes"),
        (lambda: ShardedTensor("bad.key", torch.zeros(4), torch.float16, (4,), (4,), (0,)), "disagrees with dtype"),
        (lambda: ShardedTensor("bad.key", torch.zeros(4), None, (5,), (5,), (0,)), "disagrees with local_shape"),
        (lambda: ShardedTensor("bad.key", torch.zeros(4), None, (4,), (8,), (4,), axis_fragmentations=(3,)),
         "do not tile"),
        (lambda: ShardedTensor.from_rank_offsets_flat("bad.key", torch.zeros(5), (2, 3), flattened_range=slice(2, 7)),
         "outside the flattened local shard"),
        (lambda: ShardedTensor.from_rank_offsets_flat("bad.key", torch.zeros(3), (2, 3), flattened_range=slice(0, 4)),
         "1-D with 4 elements"),
        (lambda: ShardedTensor.from_rank_offsets("bad.key", torch.zeros(4), replica_id=-1), "replica_id"),
        (lambda: ShardedObject("bad.key", 1, (2,), (2,)), "offset 2 outside"),
        (lambda: ShardedTensorFactory("bad.key", torch.zeros(1), None, None), "callable"),
    ],
)
def test_inconsistent_metadata_names_key(build, fragment):
    with pytest.raises(ShardingError) as info:
        build()
    assert "bad.key" in str(info.value)
    assert fragment in str(info.value)


def test_replica_tuple_main():
    assert ShardedTensor.from_rank_offsets("w", torch.zeros(2), replica_id=(0, 0)).is_main_replica
    assert not ShardedTensor.from_rank_offsets("w", torch.zeros(2), replica_id=(0, 1)).is_main_replica
