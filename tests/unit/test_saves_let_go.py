"""A finished save keeps no reference to what it wrote: its plan and the tensors it wrote (an async
save's staged copies) are freed once the caller lets go of the request, not when a later save comes
(storage/workers.py: an idle kept thread held its last task, whose closure held the save)."""

import threading
import weakref

import torch

import lightning_distckpt as ldc


def test_a_finished_async_save_is_freed_with_its_request(tmp_path):
    state = {"w": ldc.ShardedTensor.from_rank_offsets("w", torch.arange(4096.0)), "step": 3}
    for i in range(3):  # each save's blobs go to a kept thread, which then waits for the next task
        request = ldc.save(state, str(tmp_path / f"ck{i}"), async_save=True)
        freed = threading.Event()
        weakref.finalize(request._prep, freed.set)  # the save's plan, its writes and their staged copies
        request.wait()
        request.finalize()
        del request
        # an event, not a clock: set the moment the last reference goes; never set while a thread keeps one
        assert freed.wait(timeout=60), f"save {i}: a finished async save is still referenced"
    assert torch.equal(ldc.load({"w": ldc.ShardedTensor.from_rank_offsets("w", torch.zeros(4096))},
                                str(tmp_path / "ck2"))["w"], torch.arange(4096.0))
