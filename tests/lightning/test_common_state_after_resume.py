"""No false "common state differs between ranks" warning on the resume paths, and every rank's
``ModelCheckpoint`` state the same as rank 0's after each resume.

What was found (helper-76): a Trainer with checkpoint tiers logged, at every local save (the first run's
as well as a resumed one's), ``ModelCheckpoint{...}.kth_value: missing on ranks [1]`` on rank 0 and
Megatron-Core's "Rank 1 common state dict differs from rank 0 common state dict" on rank 1: a warning that
blames the user's job for our own doing. The strategies give a checkpoint's plain tensors (callback scores:
``kth_value``, ``best_k_models``' scores) from rank 0 only (``rank_zero_tensors``: rank-local values, as stock
Lightning saves rank 0's checkpoint), for the save to store them as replicated tensors (``shard_tensors``).
``lightning_distckpt.save`` does that; ``LocalTier.save`` handed the tree to its saver as it was, so there
they stayed common state on rank 0 and were missing on the others. ``LocalTier.save`` now shards the tree as
``save`` does (``tiers/local_tier._as_saved``): the local checkpoint is laid out as the durable one.

Cases, one launch of 2 gloo processes (real Trainer fits; GROUP_TIMEOUT_S is the hang guard):

* ``tiers``: DistCheckpointStrategy with tiers, a monitored ``ModelCheckpoint`` (top-k 2, ``sync_dist``) and an
  unmonitored one (``kth_value`` inf, as the ``TierCheckpoint``'s): fit, then ``ckpt_path="last"`` restored from
  the local tier and saved on. Failed on the old code (warnings at both fits).
* ``dcp``: a stock ``ModelParallelStrategy`` (DCP) checkpoint resumed under DistCheckpointModelParallelStrategy
  with tiers, saved on (durable and local); then ``ckpt_path="last"`` from its local tier. Failed on the old
  code (the local saves' warnings).
* ``differs``: a callback whose state truly differs by rank still warns, naming it (and nothing else: the old
  code named ``kth_value`` beside it).
"""

import pytest

from tier_parity_scripts import AGREED, run_trainer_script

pytestmark = pytest.mark.tiers

RANKS = r"""import logging
import shutil
from datetime import timedelta

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn

from lightning_distckpt.lightning.tiers import tier_callback
from tier_parity_scripts import GROUP_TIMEOUT_S, Recorder, StepModule, dist_strategy, tier_config

folder, out = sys.argv[1:3]
record = Recorder(out, rank)


class Said(logging.Handler):
    # every WARNING of the common-state check (both its lines: rank 0's and a differing rank's own)
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines = []

    def emit(self, rec):
        self.lines.append(rec.getMessage())


said = Said()
logging.getLogger("lightning_distckpt.saving.common_warning").addHandler(said)


class Net(StepModule):
    def __init__(self, fsdp=False, rising=False):
        super().__init__()
        torch.manual_seed(0)
        self.fsdp, self.rising = fsdp, rising
        self.a = nn.Linear(3, 2)

    def forward(self, x):
        return self.a(x)

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        score = self.global_step if self.rising else self.global_step % 3  # the same on every rank
        self.log("score", float(score), sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class RankState(Callback):
    # state that truly differs by rank: the check must still say so
    def state_dict(self):
        return {"rank": dist.get_rank()}


def plain(v):
    if isinstance(v, torch.Tensor):
        return v.item()
    return {str(k): plain(x) for k, x in v.items()} if isinstance(v, dict) else v


def fit(root, steps, strategy, fsdp=False, ckpt_path=None, extra=()):
    # fsdp: under the ModelParallel strategies, with a rising score and every unmonitored checkpoint kept (a
    # stock DCP directory is none of ours to remove: the restored top-k stays the best, none is rotated out)
    # a real fit to steps; the common-state warnings it logged, the tier point it restored, and every
    # ModelCheckpoint's state (the TierCheckpoint's too) by state key
    cbs = [ModelCheckpoint(os.path.join(root, "top"), monitor="score", save_top_k=2, every_n_train_steps=1),
           ModelCheckpoint(os.path.join(root, "plain"), every_n_train_steps=2, save_last=True,
                           save_top_k=-1 if fsdp else 1), *extra]
    trainer = Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=steps, callbacks=cbs, logger=False,
                      enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                      default_root_dir=root, use_distributed_sampler=False)
    said.lines.clear()
    trainer.fit(Net(fsdp, rising=fsdp), ckpt_path=ckpt_path)
    tier = tier_callback(trainer)
    point = tier.local_tier.last_point if tier is not None and tier.local_tier is not None else None
    return {"said": list(said.lines), "point": None if point is None else [point.step, point.source],
            "states": {cb.state_key: plain(cb.state_dict()) for cb in trainer.checkpoint_callbacks}}


def tiers():
    root = os.path.join(folder, "tiers")
    first = fit(root, 3, dist_strategy("ddp", tier_config(root)))
    return {"first": first, "resumed": fit(root, 5, dist_strategy("ddp", tier_config(root)), ckpt_path="last")}


def dcp():
    root = os.path.join(folder, "dcp")
    stock = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1,
                                  timeout=timedelta(seconds=GROUP_TIMEOUT_S))
    fit(root, 3, stock, fsdp=True)  # DCP directories; our saves may not replace them: last moved away
    if rank == 0:
        shutil.move(os.path.join(root, "plain", "last.ckpt"), os.path.join(folder, "stock_last"))
    dist.barrier()
    resumed = fit(root, 5, dist_strategy("mp", tier_config(root)), fsdp=True,
                  ckpt_path=os.path.join(folder, "stock_last"))
    local = fit(root, 6, dist_strategy("mp", tier_config(root)), fsdp=True, ckpt_path="last")
    return {"resumed": resumed, "local": local}


def differs():
    root = os.path.join(folder, "differs")
    return fit(root, 1, dist_strategy("ddp", tier_config(root)), extra=[RankState()])


record("tiers", tiers)
record("dcp", dcp)
record("differs", differs)
"""


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_trainer_script(tmp_path_factory.mktemp("common_after_resume"), RANKS, [], agreed=AGREED)


def _fit(results, case, part):
    """The fit ``part`` of ``case``: no common-state warning on any rank, and each rank's ModelCheckpoint
    states equal to rank 0's; rank 0's."""
    fits = [res[case][1][part] for res in results]
    for rank, got in enumerate(fits):
        assert got["said"] == [], (case, part, rank, got["said"])
        assert got["states"] == fits[0]["states"], (case, part, rank, got["states"], fits[0]["states"])
    return fits[0]


def _state(fit, monitor):
    return next(v for k, v in fit["states"].items() if k.startswith(f"ModelCheckpoint{{'monitor': {monitor!r}"))


def test_tier_saves_and_local_resume_say_nothing_and_agree(results):
    _fit(results, "tiers", "first")
    resumed = _fit(results, "tiers", "resumed")
    assert resumed["point"] == [3, "local"]  # restored from the local tier
    top = _state(resumed, "score")
    # scores 0, 1, 2, 0, 1 logged at steps 1..5: the two 0s are the top 2 (step 4's 0 was not better than
    # the kth: the restored top-k decided it, on every rank alike)
    assert sorted(top["best_k_models"].values()) == [0.0, 0.0] and top["kth_value"] == 0.0, top
    plain = _state(resumed, None)
    assert plain["last_model_path"].endswith("last.ckpt") and plain["kth_value"] == float("inf"), plain


def test_stock_dcp_resume_then_local_resume_say_nothing_and_agree(results):
    resumed = _fit(results, "dcp", "resumed")
    assert len(_state(resumed, "score")["best_k_models"]) == 2  # the stock run's top-k restored, kept on
    local = _fit(results, "dcp", "local")
    assert local["point"] == [5, "local"]


def test_state_that_truly_differs_by_rank_still_warns(results):
    rank0, rank1 = (res["differs"][1]["said"] for res in results)
    assert any("differs between ranks" in line and "RankState" in line and "on ranks [1]" in line
               for line in rank0), rank0
    assert any(line.startswith("Rank 1 common state dict differs") and "'rank'" in line for line in rank1), rank1
    assert not any("kth_value" in line for line in rank0 + rank1), (rank0, rank1)
