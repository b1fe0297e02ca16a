"""The records a rank sends the save coordinator travel as plain tuples (issue 29: pickling 10,000
dataclass records cost a 10,000-key save ~10 ms on the sender): what the coordinator rebuilds is
equal to what was described, field for field, through a real pickle round trip."""

import pickle

import torch

import lightning_distckpt as ldc
from lightning_distckpt.planning.even import mark_even
from lightning_distckpt.planning.groups import RankRecords
from lightning_distckpt.planning.metadata import ObjectRecord, ShardRecord
from lightning_distckpt.saving.save_coordinate import _as_tuples, _from_tuples


def test_records_survive_the_trip_to_the_coordinator():
    tensors = [
        ldc.ShardedTensor.from_rank_offsets("even", torch.zeros(4, 3), (0, 1, 2)),
        ldc.ShardedTensor.from_rank_offsets("rep", torch.zeros(5, dtype=torch.bfloat16), replica_id=1),
        ldc.ShardedTensor.from_rank_offsets("tp", torch.zeros(2, 6), (1, 1, 2), replica_id=0),
        ldc.ShardedTensor.from_rank_offsets_flat("flat", torch.zeros(6), (4, 3), (0, 1, 2),
                                                 flattened_range=slice(2, 8)),
    ]
    objects = [ldc.ShardedObject("rng", {"seed": 1}, (2,), (1,), replica_id=0)]
    records = mark_even(RankRecords([ShardRecord.of(t, 1) for t in tensors],
                                    [ObjectRecord.of(o, 1) for o in objects]), 2)
    assert records.even  # the even chunk is marked, and stays so
    back = _from_tuples(pickle.loads(pickle.dumps(_as_tuples(records))))
    assert back == records
    assert [r.__dict__ for r in back.tensors] == [r.__dict__ for r in records.tensors]
    assert all(type(r) is ShardRecord for r in back.tensors)
    assert hash(back.tensors[1]) == hash(records.tensors[1])  # usable as dict keys, as planning does
