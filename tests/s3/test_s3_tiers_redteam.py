"""Node-local tiers whose durable tier is ``s3://`` (moto's server on loopback, this folder's fixtures), red
team: the tier marker ``tiers-last.json`` is an object in the TierCheckpoint's S3 folder, read at setup (the
run whose local steps the Trainer continues) and written by rank 0 at the first local save. A loopback relay
in front of the server answers chosen requests itself with an S3 error (XML naming an access key) and passes
every other request on.

Run as a script (``python test_s3_tiers_redteam.py marker_write --dir URL --local DIR --out OUT``), this file
is one rank of a 2-process Trainer (tests/script_ranks.py starts them as torchrun would)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from datetime import timedelta

import pytest

from relay import LEAKS, Relay

HERE = os.path.dirname(os.path.abspath(__file__))
def _relay(endpoint, deny):
    return Relay.to(endpoint, deny=deny)


def _trainer(dirpath, local_dir, steps, devices=1, ranks_per_node=None):
    from lightning.pytorch import Trainer

    from lightning_distckpt.lightning import DistCheckpointStrategy
    from lightning_distckpt.lightning.tiers import TierCheckpoint
    from lightning_distckpt.tiers import TierOptions

    options = TierOptions(local_dir=local_dir, local_every_n_steps=2, durable_every_n_steps=4, replicas=0,
                          ranks_per_node=ranks_per_node)
    strategy = DistCheckpointStrategy(timeout=timedelta(seconds=60)) if devices > 1 else DistCheckpointStrategy()
    return Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=steps, max_epochs=-1,
                   callbacks=[TierCheckpoint(options, dirpath=dirpath)], logger=False, enable_progress_bar=False,
                   enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0)


# -- tests (pytest) -------------------------------------------------------------------------------------------
def test_an_unreadable_marker_is_an_error_at_setup_not_a_new_run(bucket, endpoint, tmp_path, monkeypatch):
    """The marker exists (run R, local steps of R) but rank 0's GET of it at setup fails (the later ones
    succeed). Before: read as "no marker", the Trainer named a new run, silently: R's local steps were never
    resumed (and pruned by its saves), its own were recorded under a run the marker (kept, naming R) does not
    name, so a restart with "last" resumed none of them either. (A failure that lasted made rank 0 alone raise
    at the first local save.) Now: a CheckpointingError at setup naming the marker, without the server's XML."""
    pytest.importorskip("s3fs")
    from lightning.pytorch.demos.boring_classes import BoringModel

    from lightning_distckpt.core.errors import CheckpointingError
    from s3_helpers import keys

    dirpath, local = f"s3://{bucket}/run", str(tmp_path / "local")
    _trainer(dirpath, local, 3).fit(BoringModel())  # local save at 2: the marker names its run
    assert "run/tiers-last.json" in keys(endpoint, bucket)
    gets = []

    def first_get_of_the_marker(method, path):  # a transient failure: the setup's read, the later ones answered
        gets.append(method == "GET" and path == f"/{bucket}/run/tiers-last.json")
        return gets[-1] and gets.count(True) == 1

    relay = _relay(endpoint, first_get_of_the_marker)
    monkeypatch.setenv("AWS_ENDPOINT_URL", relay.url)
    try:
        with pytest.raises(CheckpointingError) as raised:
            _trainer(dirpath, local, 3).fit(BoringModel())
    finally:
        relay.close()
    text = str(raised.value)
    assert relay.denied and f"{dirpath}/tiers-last.json" in text and "access denied" in text, text
    assert not any(leak in text for leak in LEAKS), text


def test_a_marker_write_failing_on_rank_0_fails_every_rank_alike(bucket, endpoint, tmp_path):
    """2 processes (2 simulated nodes); rank 0's PUT of the marker at the first local save is denied. Before:
    rank 0 alone raised from ``on_train_batch_end``; rank 1 went on into the next step's all-reduce and got
    gloo's "connection closed" (with NCCL: waited for the timeout). Now every rank raises the same
    CheckpointingError naming the marker (one broadcast, at the first local save of a fit only)."""
    pytest.importorskip("s3fs")
    from script_ranks import run_ranks, script_env

    relay = _relay(endpoint, lambda method, path: method == "PUT" and path == f"/{bucket}/run/tiers-last.json")
    out = str(tmp_path / "out")
    env = {**script_env(), "AWS_ENDPOINT_URL": relay.url}
    try:
        code, output = run_ranks(__file__, ["marker_write", "--dir", f"s3://{bucket}/run", "--local",
                                            str(tmp_path / "local" / "{node}"), "--out", out], env, 2, timeout=150)
    finally:
        relay.close()
    errors = []
    for rank in range(2):
        with open(f"{out}.rank{rank}.json") as f:
            errors.append(json.load(f).get("error", ""))
    assert relay.denied, output[-4000:]
    for text in errors:
        assert text.startswith("CheckpointingError: tiers: ") and "tiers-last.json" in text, (errors, output[-4000:])
        assert "access denied" in text and not any(leak in text for leak in LEAKS), text
    assert errors[0] == errors[1]


# -- one rank of a Trainer (script) ---------------------------------------------------------------------------
def _marker_write(args):
    from lightning.pytorch.demos.boring_classes import BoringModel

    _trainer(args.dir, args.local, 5, devices=2, ranks_per_node=1).fit(BoringModel())


def _main():
    p = argparse.ArgumentParser()
    p.add_argument("scenario", choices=["marker_write"])
    p.add_argument("--dir", required=True)
    p.add_argument("--local", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    res = {}
    try:
        _marker_write(args)
    except BaseException as e:  # what each rank raised, first line: compared across ranks
        res["error"] = f"{type(e).__name__}: {e}".splitlines()[0]
        res["traceback"] = traceback.format_exc()
    with open(f"{args.out}.rank{os.environ.get('LOCAL_RANK', '0')}.json", "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(HERE))  # tests/
    _main()
