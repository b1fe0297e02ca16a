"""``fit(ckpt_path="last")`` with checkpoints in an ``s3://`` folder, in real 2-process Trainer fits against
moto's S3 server on loopback. Lightning's stock ``ModelCheckpoint`` lists an S3 folder without the scheme
and looks the names up on the local disk (Lightning issue #18261), so ``"last"`` finds nothing and the run
starts from scratch with only Lightning's generic warning. ``DistModelCheckpoint`` finds them. With a stock
callback, under ``DistCheckpointStrategy`` (at setup) and under stock DDP with the ``DistCheckpointIO``
plugin (at its first save), a fit that starts from scratch now warns on rank 0, naming the newest committed
last checkpoint there and how to resume it; it never resumes from it unasked.

This file is also the script the ranks run: ``python test_s3_resume_last.py MODE DIR OUT``."""

from __future__ import annotations

import json
import logging
import os
import re
import sys
from datetime import timedelta

import pytest

CASES = ("strategy_dist_callback", "strategy_stock_callback", "plugin_stock_callback")
WARNED = re.compile(r"To resume, pass fit\(ckpt_path=\"(s3://[^\"]+)\"\)")


def _fits(mode: str, dirpath: str, out: str) -> None:
    """Rank script: a fit of 4 steps (last.ckpt at steps 2 and 4), a fit with ckpt_path="last", and (stock
    callback) a fit resuming from the checkpoint the warning named. Writes ``OUT.rank<r>.json``."""
    from lightning.pytorch import Callback, Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.demos.boring_classes import BoringModel
    from lightning.pytorch.strategies import DDPStrategy

    import lightning_distckpt
    from lightning_distckpt.lightning import DistCheckpointIO, DistCheckpointStrategy, DistModelCheckpoint

    warnings = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            warnings.append(record.getMessage())

    logging.getLogger("lightning_distckpt").addHandler(Collect(logging.WARNING))

    class FirstStep(Callback):
        def on_train_start(self, trainer, module):
            self.step = trainer.global_step

    def fit(steps, ckpt_path=None):
        warnings.clear()
        cls = DistModelCheckpoint if mode == "strategy_dist_callback" else ModelCheckpoint
        first = FirstStep()
        timeout = timedelta(seconds=90)
        plugin = mode.startswith("plugin")
        t = Trainer(accelerator="cpu", devices=2, max_steps=steps, logger=False, enable_progress_bar=False,
                    enable_model_summary=False, limit_val_batches=0, default_root_dir=os.path.dirname(out),
                    strategy=DDPStrategy(timeout=timeout) if plugin else DistCheckpointStrategy(timeout=timeout),
                    plugins=[DistCheckpointIO()] if plugin else [],
                    callbacks=[cls(dirpath=dirpath, every_n_train_steps=2, save_top_k=0, save_last=True), first])
        t.fit(BoringModel(), ckpt_path=ckpt_path)
        return {"resumed_from": t.ckpt_path, "first_step": first.step, "warnings": list(warnings)}, t.global_rank

    res = {"package": lightning_distckpt.__file__}
    res["fresh"], rank = fit(4)
    res["last"], _ = fit(6, "last")
    named = [m.group(1) for w in res["last"]["warnings"] for m in [WARNED.search(w)] if m]
    if mode != "strategy_dist_callback":  # the advice, followed on every rank (rank 0's words, broadcast)
        import torch.distributed as dist
        box = [named[0] if named else None]
        dist.broadcast_object_list(box, src=0)
        res["advised"], _ = fit(8, box[0]) if box[0] else ({}, None)
    with open(f"{out}.rank{rank}.json", "w") as f:
        json.dump(res, f, default=str)


if __name__ == "__main__":
    _fits(*sys.argv[1:4])
    sys.exit(0)

pytest.importorskip("moto.server")
pytest.importorskip("s3fs")
from script_ranks import run_ranks, script_env  # noqa: E402


def _run(case, bucket, tmp_path):
    """Both ranks' results of the three fits of ``case`` in ``s3://BUCKET/run/ckpts``."""
    dirpath, out = f"s3://{bucket}/run/ckpts", str(tmp_path / "res")
    code, output = run_ranks(os.path.abspath(__file__), [case, dirpath, out], script_env(), 2, timeout=600)
    results = []
    for rank in range(2):
        path = f"{out}.rank{rank}.json"
        assert code == 0 and os.path.isfile(path), f"exit {code}:\n{output[-8000:]}"
        with open(path) as f:
            results.append(json.load(f))
    print("lightning_distckpt imported from", results[0]["package"])
    return dirpath, results


def test_dist_model_checkpoint_resumes_last_on_s3(bucket, tmp_path):
    """DistCheckpointStrategy + DistModelCheckpoint(dirpath="s3://..."): ckpt_path="last" resumes the
    committed last.ckpt (step 4) on both ranks, and nothing is warned."""
    dirpath, results = _run("strategy_dist_callback", bucket, tmp_path)
    for res in results:
        assert res["fresh"]["first_step"] == 0 and res["fresh"]["warnings"] == []
        assert res["last"]["resumed_from"] == f"{dirpath}/last.ckpt/COMMITTED"
        assert res["last"]["first_step"] == 4
        assert res["last"]["warnings"] == []


@pytest.mark.parametrize("case", ["strategy_stock_callback", "plugin_stock_callback"])
def test_stock_model_checkpoint_on_s3_says_what_last_missed(case, bucket, tmp_path):
    """A stock ModelCheckpoint(dirpath="s3://...") under DistCheckpointStrategy, or under stock DDP with the
    DistCheckpointIO plugin: the first fit (empty folder) warns nothing; ckpt_path="last" still starts from
    step 0 (Lightning resolves "last"; nothing is resumed unasked), but rank 0 now warns once, naming
    s3://.../last.ckpt and how to resume; following that advice resumes step 4 on both ranks, unwarned."""
    dirpath, results = _run(case, bucket, tmp_path)
    for rank, res in enumerate(results):
        assert res["fresh"]["first_step"] == 0 and res["fresh"]["warnings"] == [], res["fresh"]
        assert res["last"]["resumed_from"] is None and res["last"]["first_step"] == 0, res["last"]
        named = [w for w in res["last"]["warnings"] if "Lightning issue #18261" in w]
        assert len(named) == (1 if rank == 0 else 0), res["last"]["warnings"]
        assert res["advised"]["resumed_from"] == f"{dirpath}/last.ckpt", res["advised"]
        assert res["advised"]["first_step"] == 4
        assert not [w for w in res["advised"]["warnings"] if "#18261" in w]  # a resumed fit: nothing to say
    message = [w for w in results[0]["last"]["warnings"] if "#18261" in w][0]
    assert f"ModelCheckpoint(dirpath={dirpath!r})" in message and "DistModelCheckpoint" in message
