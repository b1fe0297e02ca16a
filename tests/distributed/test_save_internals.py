"""The save path's agreements and records: per-rank failures keep their type and name their ranks
(prepare, write, commit), the metadata's backend comes from the writer, plans carry positions."""

import dataclasses
import json
import os

import torch

import lightning_distckpt as ldc
from lightning_distckpt.comm import get_comm
from lightning_distckpt.storage.layout import METADATA_FILE
from lightning_distckpt.storage.tensorstore_io import TensorStoreIO
from lightning_distckpt.saving.save import finalize_save, prepare_save, write_local
from dist_utils import run_distributed


def _factory_state(rank, world, failing):
    """A factory whose build_fn raises ``failing[rank]`` (an error class name) on that rank."""

    def build(key, data, replica_id, flat):
        if rank in failing:
            raise getattr(ldc, failing[rank])(f"factory {key!r} refuses to build on rank {rank}")
        return {"w": ldc.ShardedTensor.from_rank_offsets(key, data, (0, rank, world))}

    return {"f": ldc.ShardedTensorFactory("w", torch.ones(2), build, lambda sub: sub["w"])}


def _prepare_failures(rank, world, root):
    out = {}
    cases = {"one": {1: "ValidationError"}, "both": {0: "ValidationError", 1: "ValidationError"},
             "mixed": {0: "ShardingError", 1: "ValidationError"}}
    for name, failing in cases.items():
        try:
            ldc.save(_factory_state(rank, world, failing), f"{root}/{name}")
            out[name] = None
        except ldc.CheckpointingError as e:
            out[name] = (type(e).__name__, {rk: f.type_name for rk, f in e.failures.items()}, str(e))
    get_comm().barrier()
    out["written"] = sorted(os.listdir(root))
    return out


def test_per_rank_prepare_errors_keep_their_type_and_name_the_ranks(tmp_path):
    for r in run_distributed(_prepare_failures, 2, str(tmp_path)):
        kind, failures, msg = r["one"]
        assert kind == "ValidationError" and failures == {1: "ValidationError"}
        assert "failed before writing" in msg and "rank 1: factory 'w' refuses to build on rank 1" in msg
        assert "rank 0" not in msg
        assert r["both"][:2] == ("ValidationError", {0: "ValidationError", 1: "ValidationError"})
        # ranks disagreeing on the type: the common base, every rank's own type kept in failures
        assert r["mixed"][:2] == ("CheckpointingError", {0: "ShardingError", 1: "ValidationError"})
        assert r["written"] == []  # nothing written, no staging directory left


def _finalize_failures(rank, world, root):
    sd = {"w": ldc.ShardedTensor.from_rank_offsets("w", torch.full((4,), float(rank)), (0, rank, world))}
    out = {}

    def attempt(name, outcome_of, in_the_way=False):
        prep = prepare_save(sd, f"{root}/{name}", get_comm())
        local = write_local(prep)
        if in_the_way and rank == 0:
            with open(f"{root}/{name}", "w") as f:
                f.write("not a checkpoint")
        try:
            finalize_save(prep, outcome_of(local))
            out[name] = None
        except ldc.CheckpointingError as e:
            out[name] = (type(e).__name__, {rk: (f.type_name, f.message) for rk, f in e.failures.items()}, str(e))

    # rank 1's write failed with a foreign error (what serialization.save hands over)
    attempt("one", lambda local: OSError("disk full") if rank == 1 else local)
    # every rank failed with the same library error: still a SaveFailedError, types kept per rank
    attempt("both", lambda local: ldc.ShardingError(f"cannot write on rank {rank}"))
    # every write succeeded, the commit on rank 0 found a file in the way
    attempt("commit", lambda local: local, in_the_way=True)
    get_comm().barrier()  # rank 0 removes the staging directory after raising
    out["left"] = sorted(os.listdir(root))
    return out


def test_finalize_failures_raise_save_failed_with_failures(tmp_path):
    for r in run_distributed(_finalize_failures, 2, str(tmp_path)):
        kind, failures, msg = r["one"]
        assert kind == "SaveFailedError" and failures == {1: ("OSError", "disk full")}
        assert "nothing was committed" in msg and "rank 1: OSError: disk full" in msg
        kind, failures, _ = r["both"]
        assert kind == "SaveFailedError"
        assert failures == {rk: ("ShardingError", f"cannot write on rank {rk}") for rk in (0, 1)}
        kind, failures, msg = r["commit"]
        assert kind == "SaveFailedError" and list(failures) == [0] and failures[0][0] == "CheckpointingError"
        assert "commit failed, nothing was committed" in msg and "not a directory" in msg
        assert r["left"] == ["commit"]  # the file in the way; no checkpoint, no staging directory


class _RenamedStore(TensorStoreIO):
    """The same bytes under another backend name: what metadata.json records follows the writer."""

    backend = "tensorstore-renamed"


def test_metadata_backend_comes_from_the_writer(tmp_path):
    sd = {"w": ldc.ShardedTensor.from_rank_offsets("w", torch.arange(4.0))}
    ldc.save(sd, tmp_path / "default")
    stored = json.loads((tmp_path / "default" / METADATA_FILE).read_text())
    assert stored["storage"]["backend"] == TensorStoreIO.backend

    prep = prepare_save(sd, str(tmp_path / "renamed"), get_comm())
    prep = dataclasses.replace(prep, writer=_RenamedStore(prep.staging, prep.options))
    finalize_save(prep, write_local(prep))
    stored = json.loads((tmp_path / "renamed" / METADATA_FILE).read_text())
    assert stored["storage"]["backend"] == "tensorstore-renamed"


def test_chunks_are_cut_as_evenly_as_the_chunk_size_allows():
    """zarr stores the last chunk whole: a tensor just over one chunk must not store nearly two."""
    from lightning_distckpt.storage.array_metadata import chunk_shape

    mib = 1 << 20
    assert chunk_shape((11008, 4096), 2, 64 * mib) == [5504, 4096]  # 86 MiB: two chunks of 43 MiB, not 64 + 64
    assert chunk_shape((8192, 4096), 2, 64 * mib) == [8192, 4096]  # exactly one chunk
    for rows, row_bytes, limit in [(1000, 40, 4096), (1015, 40, 4096), (7, 1 << 20, 1024), (1, 8, 64),
                                   (50257, 8192, 64 * mib)]:
        chunk = chunk_shape((rows, row_bytes), 1, limit)[0]
        count = -(-rows // chunk)
        assert chunk * row_bytes <= max(limit, row_bytes)  # within the chunk size (or one row)
        assert count == -(-rows // max(1, limit // row_bytes))  # no more chunks than cutting at the limit
        assert count * chunk - rows < count  # padding: less than one row per chunk
