"""Real Trainer runs for tests/test_lightning_*.py, launched as ``python trainer_scenarios.py SCENARIO ...``.

The tests start one process per rank (``tests/script_ranks.py``, as torchrun would); run by hand
with ``--devices N > 1``, Lightning's own launcher re-runs it for ranks 1..N-1. Several
Trainers run one after another in the same processes. Every rank writes what it saw to
``OUT.rank<r>.json``; the tests assert on those files.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
from datetime import timedelta
from typing import Any, Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # tests/ (lightning_helpers)

from scenario_runner import scenario_main  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch import Callback, Trainer  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy  # noqa: E402

from lightning_distckpt import CheckpointingError, ShardedTensor, load_common_state_dict  # noqa: E402
from lightning_distckpt.lightning import DistCheckpointIO, DistCheckpointStrategy  # noqa: E402
from lightning_distckpt.lightning.parallel import ParallelState, module_sharded_state_dict  # noqa: E402
from lightning_distckpt.storage.layout import read_metadata  # noqa: E402
from torch.nn import functional as F  # noqa: E402
from example_layers import ColumnParallelLinear, RowParallelLinear  # noqa: E402
from lightning_helpers import TEST_STEP, TPMLP, StepCounter, full_weights, optimizer_full_state  # noqa: E402
from omegaconf import DictConfig, OmegaConf  # noqa: E402

TIMEOUT = timedelta(seconds=90)  # a hang fails the test instead of blocking it


def trainer(args: argparse.Namespace, strategy: Any, max_steps: int, callbacks: List[Any] = (), **kw: Any) -> Trainer:
    return Trainer(
        accelerator="cpu", devices=args.devices, strategy=strategy, max_steps=max_steps, max_epochs=-1,
        callbacks=list(callbacks), logger=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, **kw,
    )


def strategy_for(args: argparse.Namespace, **cfg: Any) -> Any:
    if args.mode == "plugin":
        return DDPStrategy(timeout=TIMEOUT) if args.devices > 1 else "auto"
    return DistCheckpointStrategy(tensor_parallel_size=args.tp, timeout=TIMEOUT, checkpoint=cfg or None)


def plugins_for(args: argparse.Namespace) -> List[Any]:
    return [DistCheckpointIO()] if args.mode == "plugin" else []


def snapshot(model: TPMLP, trainer_: Trainer) -> Dict[str, Any]:
    opt = trainer_.optimizers[0]
    return {
        "weights": full_weights(model),
        "opt": optimizer_full_state(model, opt),
        "lr": [g["lr"] for g in opt.param_groups],
        "sched": trainer_.lr_scheduler_configs[0].scheduler.state_dict(),
        "global_step": trainer_.global_step,
        "epoch": trainer_.current_epoch,
        "losses": dict(model.losses),
    }


def same(a: Dict[str, Any], b: Dict[str, Any]) -> Dict[str, bool]:
    """Exact equality of two snapshots, item by item."""
    out = {}
    for k in ("weights", "opt"):
        out[k] = set(a[k]) == set(b[k]) and all(torch.equal(a[k][n], b[k][n]) for n in a[k])
    for k in ("lr", "sched", "global_step", "epoch"):
        out[k] = a[k] == b[k]
    return out


# -- scenarios ----------------------------------------------------------------------------
def exact_resume(args: argparse.Namespace, res: Dict[str, Any], make_strategy: Any = None, name: str = "exact") -> None:
    """A: 6 steps straight. B: 3 steps with a checkpoint every 3 steps. C: resume B's checkpoint to 6.
    C must end exactly where A did (weights, optimizer, schedulers, loops, losses)."""
    make_strategy = make_strategy or (lambda: strategy_for(args))
    hp = dict(total_steps=6, conf=OmegaConf.create({"optim": {"name": "adamw", "betas": [0.9, 0.99]}}))
    a_model = TPMLP(**hp)
    a = trainer(args, make_strategy(), 6, plugins=plugins_for(args), enable_checkpointing=False)
    a.fit(a_model)
    snap_a = snapshot(a_model, a)

    ckdir = os.path.join(args.dir, name)
    b_model = TPMLP(**hp)
    cb = ModelCheckpoint(dirpath=ckdir, filename="{step}", every_n_train_steps=3, save_top_k=-1)
    b = trainer(args, make_strategy(), 3, [cb, StepCounter()], plugins=plugins_for(args))
    b.fit(b_model)
    ckpt = os.path.join(ckdir, "step=3.ckpt")

    c_model = TPMLP(**hp)
    cb_c = ModelCheckpoint(dirpath=ckdir, filename="{step}", every_n_train_steps=3, save_top_k=-1)
    counter = StepCounter()
    c = trainer(args, make_strategy(), 6, [cb_c, counter], plugins=plugins_for(args))
    c.fit(c_model, ckpt_path=ckpt)
    res["callback_count"] = counter.count  # 3 restored + 3 new
    common = load_common_state_dict(ckpt)
    conf = common["hyper_parameters"]["conf"]
    res["hparams_conf"] = [type(conf).__name__, OmegaConf.to_container(conf)]
    res["hparams_conf_is_dictconfig"] = isinstance(c_model.hparams.conf, DictConfig)
    snap_c = snapshot(c_model, c)
    res["exact"] = same(snap_a, snap_c)
    res["losses_a"] = snap_a["losses"]
    res["losses_c"] = snap_c["losses"]
    res["resumed_global_step"] = snap_c["global_step"]
    res["checkpoint"] = ckpt
    res["rank_dirs"] = sorted(os.listdir(os.path.join(ckpt, "data")))
    res["ckpt_world_size"] = read_metadata(ckpt)["world_size"]
    # Trainer.test from the checkpoint: weights only, no optimizer; the module is not DDP-wrapped.
    t_model = TPMLP(**hp)
    t = trainer(args, make_strategy(), 1, plugins=plugins_for(args), enable_checkpointing=False)
    t.test(t_model, ckpt_path=ckpt, verbose=False)
    res["test_loss"] = t_model.test_losses
    res["ckpt_entries"] = sorted(os.listdir(ckpt))


class FailingSave(Callback):
    """At step 2, try saves that fail on one rank only; record what each rank saw."""

    def __init__(self, path: str, results: Dict[str, Any]) -> None:
        self.path, self.results = path, results

    def on_train_batch_end(self, trainer_: Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer_.global_step != 2:
            return
        trainer_.save_checkpoint(self.path)  # a good one first
        rank = trainer_.global_rank
        for name, fault in (("write_fails_on_rank1", "meta"), ("describe_fails_on_rank1", "raise")):
            pl_module.fault = fault if rank == 1 else None
            try:
                trainer_.save_checkpoint(self.path)
                self.results[name] = "no error"
            except CheckpointingError as e:
                self.results[name] = f"{type(e).__name__}: {e}"
            finally:
                pl_module.fault = None


class FaultyTPMLP(TPMLP):
    fault = None

    def sharded_state_dict(self, prefix: str = "") -> Dict[str, Any]:
        out = super().sharded_state_dict(prefix)
        if self.fault == "meta":  # a tensor only this rank holds, which cannot be written
            out["extra"] = ShardedTensor.from_rank_offsets("extra", torch.empty(4, device="meta"))
        elif self.fault == "raise":
            raise CheckpointingError("this rank cannot describe its state")
        return out


def failures(args: argparse.Namespace, res: Dict[str, Any]) -> None:
    path = os.path.join(args.dir, "fail", "ckpt")
    seen: Dict[str, Any] = {}
    model = FaultyTPMLP(total_steps=4)
    t = trainer(args, strategy_for(args), 4, [FailingSave(path, seen)], enable_checkpointing=False)
    t.fit(model)  # training goes on after the failed saves
    res["failures"] = seen
    res["failures_global_step"] = t.global_step
    res["good_ckpt_intact"] = os.path.isfile(os.path.join(path, "COMMITTED"))
    res["leftovers"] = sorted(n for n in os.listdir(os.path.dirname(path)) if n != "ckpt")
    res["leftover_trees"] = {n: sorted(os.path.relpath(os.path.join(d, f), os.path.dirname(path))
                                       for d, _, fs in os.walk(os.path.join(os.path.dirname(path), n)) for f in fs)
                             for n in res["leftovers"]}  # what each holds, for the failure message
    # Every rank has looked before rank 0 saves "plain" beside "ckpt": a rank still listing the folder saw that
    # save's staging directory as a leftover (a loaded run, once: `.distckpt-staging-obwgc2lo-...`, "plain")
    t.strategy.barrier()
    # A checkpoint the plugin wrote under a rank-0-only strategy is read by its tensors' paths; one that
    # lacks what the module holds is refused naming the stored keys, on every rank.
    plain = os.path.join(args.dir, "fail", "plain")
    if t.is_global_zero:
        DistCheckpointIO().save_checkpoint({"state_dict": {"fc1.weight": torch.zeros(8, 8)}}, plain)
    t.strategy.barrier()
    try:
        trainer(args, strategy_for(args), 4, enable_checkpointing=False).fit(TPMLP(total_steps=4), ckpt_path=plain)
        res["plain_refused"] = "no error"
    except CheckpointingError as e:
        res["plain_refused"] = str(e)


def nonstrict(args: argparse.Namespace, res: Dict[str, Any]) -> None:
    """Resume a model that has a layer the checkpoint lacks (so its weights and optimizer state are
    missing): strict raises on every rank; non-strict keeps the fresh values and trains on."""
    src = os.path.join(args.dir, "exact", "step=3.ckpt")
    model = TPMLP(total_steps=5, extra_layer=True)
    t = trainer(args, strategy_for(args), 5, enable_checkpointing=False)
    try:
        t.fit(model, ckpt_path=src)
        res["strict"] = "no error"
    except CheckpointingError as e:
        res["strict"] = f"{type(e).__name__}: {e}"
    model = TPMLP(total_steps=5, extra_layer=True)
    t = trainer(args, strategy_for(args, strict="log_all"), 5, enable_checkpointing=False)
    t.fit(model, ckpt_path=src)
    opt = t.optimizers[0]
    res["nonstrict_global_step"] = t.global_step
    res["nonstrict_norm_weight_fresh_then_trained"] = bool(model.norm.weight.ne(1).any())
    res["nonstrict_norm_step"] = float(opt.state[model.norm.weight]["step"])  # 2 fresh steps (3 -> 5)
    res["nonstrict_fc1_step"] = float(opt.state[model.fc1.weight]["step"])  # 3 loaded + 2
    # LightningModule.strict_loading = False asks for the same without touching the config.
    model = TPMLP(total_steps=5, extra_layer=True)
    model.strict_loading = False
    t = trainer(args, strategy_for(args), 5, enable_checkpointing=False)
    t.fit(model, ckpt_path=src)
    res["module_nonstrict_global_step"] = t.global_step

    # A weights-only checkpoint has no optimizer or scheduler state at all.
    wdir = os.path.join(args.dir, "weights_only")
    cb = ModelCheckpoint(dirpath=wdir, filename="{step}", every_n_train_steps=3, save_weights_only=True)
    saver = TPMLP(total_steps=5)
    trainer(args, strategy_for(args), 3, [cb]).fit(saver)
    loss_at_3 = loss_on_test_batch(saver)  # the saver's weights are the checkpoint's
    wo = os.path.join(wdir, "step=3.ckpt")
    try:
        trainer(args, strategy_for(args), 5, enable_checkpointing=False).fit(TPMLP(total_steps=5), ckpt_path=wo)
        res["wo_strict"] = "no error"
    except CheckpointingError as e:
        res["wo_strict"] = f"{type(e).__name__}: {e}"
    model = TPMLP(total_steps=5)
    t = trainer(args, strategy_for(args, strict="log_all"), 5, enable_checkpointing=False)
    t.fit(model, ckpt_path=wo)
    res["wo_first_step"] = min(model.losses)
    res["wo_global_step"] = t.global_step
    res["wo_fc1_opt_step"] = float(t.optimizers[0].state[model.fc1.weight]["step"])  # fresh: 2 steps
    res["wo_first_loss"] = [model.losses[TEST_STEP], loss_at_3]  # the loaded weights give the saved model's loss


def loss_on_test_batch(model: TPMLP) -> float:
    """The global-batch loss of the model as it is on step TEST_STEP's batch."""
    x, y = model.test_dataloader().batch(TEST_STEP)
    with torch.no_grad():
        value = torch.nn.functional.mse_loss(model(x), y).detach().clone()
    if model.ps.dp_size > 1:
        torch.distributed.all_reduce(value, group=model.ps.dp_group)
        value /= model.ps.dp_size
    return value.item()


def resume_other_world(args: argparse.Namespace, res: Dict[str, Any]) -> None:
    """Resume the 2-process TP2 checkpoint under this world size / TP size; record the losses."""
    model = TPMLP(total_steps=6)
    t = trainer(args, strategy_for(args), 6, enable_checkpointing=False)
    t.fit(model, ckpt_path=args.resume)
    res["losses"] = dict(model.losses)
    res["global_step"] = t.global_step
    res["parallel"] = model.ps.describe()
    res["weights_sum"] = {k: float(v.sum()) for k, v in full_weights(model).items()}


def _mlp(ps: ParallelState) -> torch.nn.ModuleDict:
    torch.manual_seed(0)
    return torch.nn.ModuleDict({"fc1": ColumnParallelLinear(6, 8, ps), "fc2": RowParallelLinear(8, 3, ps),
                                "norm": torch.nn.LayerNorm(3)})


def _forward(m: torch.nn.ModuleDict, x: torch.Tensor) -> torch.Tensor:
    return m["norm"](m["fc2"](F.gelu(m["fc1"](x))))


def tp_layers(args: argparse.Namespace, res: Dict[str, Any]) -> None:
    """In the processes Lightning launched (world of 2): the groups, and TP 2 layers against the
    un-sharded ones (outputs and gradients), and what their sharded state dict describes."""
    Trainer(accelerator="cpu", devices=args.devices, strategy=DistCheckpointStrategy(timeout=TIMEOUT), logger=False,
            enable_progress_bar=False, max_steps=0).fit(TPMLP(total_steps=1))  # initializes the world group
    rank = torch.distributed.get_rank()
    ps = ParallelState.build(tensor_parallel_size=2)
    groups = (ps.tp_size, ps.tp_rank, ps.dp_size, ps.dp_rank)
    dp_only = ParallelState.build(tensor_parallel_size=1)
    try:
        ParallelState.build(tensor_parallel_size=3)
        bad = None
    except ValueError as e:
        bad = str(e)
    # Same seed: same global weights. float64, so that the TP split's different summation order
    # (two partial matmuls and an all-reduce) stays far below the tolerance on any CPU's kernels
    # (in float32 an H100 host's CPU exceeded atol=1e-6 on two gradients).
    tp, full = _mlp(ps).double(), _mlp(ParallelState.single()).double()
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(1), dtype=torch.float64, requires_grad=True)
    x_full = x.detach().clone().requires_grad_(True)
    out, ref = _forward(tp, x), _forward(full, x_full)
    out.pow(2).sum().backward()
    ref.pow(2).sum().backward()
    rows = slice(4 * rank, 4 * (rank + 1))
    checks = {
        "out": torch.allclose(out, ref, atol=1e-6),
        "x_grad": torch.allclose(x.grad, x_full.grad, atol=1e-6),  # all-reduced over TP in backward
        "fc1_w_grad": torch.allclose(tp["fc1"].weight.grad, full["fc1"].weight.grad[rows], atol=1e-6),
        "fc1_b_grad": torch.allclose(tp["fc1"].bias.grad, full["fc1"].bias.grad[rows], atol=1e-6),
        "fc2_w_grad": torch.allclose(tp["fc2"].weight.grad, full["fc2"].weight.grad[:, rows], atol=1e-6),
        "fc2_b_grad": torch.allclose(tp["fc2"].bias.grad, full["fc2"].bias.grad, atol=1e-6),  # replicated
        "norm_grad": torch.allclose(tp["norm"].weight.grad, full["norm"].weight.grad, atol=1e-6),
    }
    sd = module_sharded_state_dict(tp, "m.", replica_id=ps.replicated_id)
    described = {k: (v.global_shape, v.global_offset, v.replica_id,
                     v.data is getattr(tp[k.split(".")[1]], k.split(".")[2])) for k, v in sd.items()}
    res["tp_layers"] = [groups, (dp_only.tp_size, dp_only.dp_size, dp_only.dp_rank), bad, checks, described]


def committed(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "COMMITTED"))


def topk_last(args: argparse.Namespace, res: Dict[str, Any]) -> None:
    """save_top_k=2 on the loss with save_last=True; then a crashed save leaves its staging directory
    behind (newer than every checkpoint), and ckpt_path="last" must still pick the committed last."""
    ckdir = os.path.join(args.dir, "topk")
    cb = ModelCheckpoint(dirpath=ckdir, filename="{step}", monitor="train_loss", save_top_k=2,
                         every_n_train_steps=1, save_last=True)
    t = trainer(args, strategy_for(args), 6, [cb], plugins=plugins_for(args))
    t.fit(TPMLP(total_steps=8))
    res["topk_listing"] = sorted(os.listdir(ckdir))
    res["topk_best"] = sorted(os.path.basename(p) for p in cb.best_k_models)
    res["topk_all_committed"] = all(committed(os.path.join(ckdir, n)) for n in os.listdir(ckdir))
    t.strategy.barrier()
    if t.is_global_zero:  # what a save killed mid-write leaves: its staging directory, uncommitted
        crashed = os.path.join(ckdir, ".last.ckpt.distckpt-staging-0123456789ab")
        shutil.copytree(os.path.join(ckdir, "last.ckpt"), crashed)
        os.remove(os.path.join(crashed, "COMMITTED"))
    t.strategy.barrier()
    cb2 = ModelCheckpoint(dirpath=ckdir, filename="{step}", monitor="train_loss", save_top_k=2,
                          every_n_train_steps=1, save_last=True)
    t2 = trainer(args, strategy_for(args), 8, [cb2], plugins=plugins_for(args))
    model = TPMLP(total_steps=8)
    t2.fit(model, ckpt_path="last")
    res["last_resumed_from"] = os.path.basename(str(t2.ckpt_path))
    res["last_first_step"] = min(model.losses)
    res["last_global_step"] = t2.global_step


def link_last(args: argparse.Namespace, res: Dict[str, Any]) -> None:
    """save_last="link": last.ckpt is a symlink to the newest checkpoint directory; resuming from it works."""
    ckdir = os.path.join(args.dir, "link")
    cb = ModelCheckpoint(dirpath=ckdir, filename="{step}", save_top_k=1, every_n_train_steps=2, save_last="link")
    t = trainer(args, strategy_for(args), 4, [cb], plugins=plugins_for(args))
    t.fit(TPMLP(total_steps=6))
    last = os.path.join(ckdir, "last.ckpt")
    res["link_listing"] = sorted(os.listdir(ckdir))
    res["link_is_symlink"] = os.path.islink(last)
    res["link_target"] = os.readlink(last) if os.path.islink(last) else None
    cb2 = ModelCheckpoint(dirpath=ckdir, filename="{step}", save_top_k=1, every_n_train_steps=2, save_last="link")
    t2 = trainer(args, strategy_for(args), 6, [cb2], plugins=plugins_for(args))
    model = TPMLP(total_steps=6)
    t2.fit(model, ckpt_path="last")
    res["link_first_step"] = min(model.losses)
    res["link_listing_after"] = sorted(os.listdir(ckdir))
    res["link_target_after"] = os.readlink(last) if os.path.islink(last) else None


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: List[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def exact_resume_yaml(args: argparse.Namespace, res: Dict[str, Any]) -> None:
    """exact_resume with the strategy built from configs/strategy_tp2.yaml (async save, two-stage
    loader, zarr layout)."""
    logs = Records()
    logging.getLogger("lightning_distckpt").addHandler(logs)
    logging.getLogger("lightning_distckpt").setLevel(logging.INFO)
    cfg = os.path.join(os.path.dirname(os.path.dirname(HERE)), "configs", "strategy_tp2.yaml")
    sub: Dict[str, Any] = {}
    exact_resume(args, sub, lambda: DistCheckpointStrategy.from_config(cfg, timeout=TIMEOUT), name="yaml")
    res["yaml_exact"] = sub["exact"]
    res["yaml_layout"] = read_metadata(sub["checkpoint"])["storage"]["layout"]
    res["yaml_async_commits"] = sum("async save" in m and "committed" in m for m in logs.messages)
    res["yaml_two_stage_loads"] = sum("two_stage" in m or "two-stage" in m for m in logs.messages)


class CountingBarriers(Callback):
    """At step 1, ``trainer.save_checkpoint`` with ``torch.distributed.barrier`` and ``torch.save``
    counted; records the barriers and ``torch.save`` calls it made and whether the checkpoint was
    committed (or pending) when it returned."""

    def __init__(self, path: str, results: Dict[str, Any]) -> None:
        self.path, self.results = path, results

    def on_train_batch_end(self, trainer_: Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer_.global_step != 1:
            return
        real, calls = torch.distributed.barrier, []
        real_save, saves = torch.save, []

        def counted(*a: Any, **k: Any) -> Any:
            calls.append(1)
            return real(*a, **k)

        def counted_save(*a: Any, **k: Any) -> Any:
            saves.append(1)
            return real_save(*a, **k)

        torch.distributed.barrier, torch.save = counted, counted_save
        try:
            trainer_.save_checkpoint(self.path)
            self.results["barriers"], self.results["torch_saves"] = len(calls), len(saves)
            self.results["committed_on_return"] = committed(self.path)
            self.results["pending"] = trainer_.strategy.checkpoint_io.pending is not None
            trainer_.strategy.barrier("Trainer.save_checkpoint")  # not right after a save: a barrier
            self.results["barriers_after"] = len(calls)
        finally:
            torch.distributed.barrier, torch.save = real, real_save


def save_barrier(args: argparse.Namespace, res: Dict[str, Any]) -> None:
    """Trainer.save_checkpoint's barrier after a save is left out: a synchronous save's commit was agreed
    by every rank (each sees it committed when it returns), a background save's plan was."""
    for name, cfg in (("sync", {}), ("async", {"async_save": True})):
        seen: Dict[str, Any] = {}
        path = os.path.join(args.dir, "barrier", name)
        t = trainer(args, strategy_for(args, **cfg), 2, [CountingBarriers(path, seen)], enable_checkpointing=False)
        t.fit(TPMLP(total_steps=2))
        res[f"barrier_{name}"] = seen
        res[f"barrier_{name}_committed_after_fit"] = committed(path)


class ReplacesStateDict(Callback):
    """Puts another dict under ``checkpoint["state_dict"]`` at each save, as ``EMAWeightAveraging`` and
    ``ModelPruning`` do: this rank's pieces, each plus 1000 (values no save of the module holds)."""

    def on_save_checkpoint(self, trainer_: Trainer, pl_module: Any, checkpoint: Dict[str, Any]) -> None:
        checkpoint["state_dict"] = {k: v.detach() + 1000 for k, v in checkpoint["state_dict"].items()}


def replaced_state_dict(args: argparse.Namespace, res: Dict[str, Any]) -> None:
    """A hook's replacement of checkpoint["state_dict"] under tensor parallelism: its tensors are this
    rank's pieces with no place in the global tensor, so the module's shards are saved, with a WARNING
    naming why (at TP 1 the hook's dict is saved: tests/conformance/test_lightning_resume_cases.py)."""
    logs = Records()
    logging.getLogger("lightning_distckpt").addHandler(logs)
    path = os.path.join(args.dir, "replaced", "step2.ckpt")
    t = trainer(args, strategy_for(args), 2, [ReplacesStateDict()], enable_checkpointing=False)
    model = TPMLP(total_steps=2)
    t.fit(model)
    t.save_checkpoint(path)
    logging.getLogger("lightning_distckpt").removeHandler(logs)
    res["replaced_warnings"] = [m for m in logs.messages if "replaced checkpoint['state_dict']" in m]
    fresh = TPMLP(total_steps=2)
    t2 = trainer(args, strategy_for(args), 2, [], enable_checkpointing=False)
    t2.fit(fresh, ckpt_path=path)  # max_steps reached: restores, trains nothing
    trained, restored = full_weights(model), full_weights(fresh)
    res["replaced_module_restored"] = set(trained) == set(restored) and all(
        torch.equal(trained[k], restored[k]) for k in trained)


SCENARIOS = {"tp_layers": tp_layers, "exact_resume": exact_resume, "failures": failures, "nonstrict": nonstrict,
             "resume_other_world": resume_other_world, "exact_resume_yaml": exact_resume_yaml, "topk_last": topk_last, "link_last": link_last, "save_barrier": save_barrier,
             "replaced_state_dict": replaced_state_dict}


if __name__ == "__main__":
    scenario_main(SCENARIOS, **{"--mode": {"choices": ("strategy", "plugin"), "default": "strategy"},
                               "--resume": {"default": None}})
