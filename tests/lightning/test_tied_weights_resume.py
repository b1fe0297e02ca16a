"""Tied weights (one Parameter under two names: an embedding tied to the output layer) resumed through the
Trainer's strategies from a checkpoint that stores the tie once, as Hugging Face saves a tied embedding: the
tie is kept (one Parameter, its optimizer state once), values bit-exact on every rank, and a genuinely
missing key still refused. Run as a script (``mp DP TP CKPT_DIR OUT``) by the ModelParallel tests, one
process per rank (tests/script_ranks.py)."""

import os
import sys

import lightning.pytorch as pl
import pytest
import torch

TIED = ("head.weight", "emb.weight")


class Tied(pl.LightningModule):
    """``head(emb(x))`` with ``head.weight`` the embedding's Parameter; under tensor parallelism both are
    sharded by vocabulary rows and tied again (``parallelize_module`` gives each module its own DTensor)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(16, 8)
        self.head = torch.nn.Linear(8, 16, bias=False)
        self.head.weight = self.emb.weight
        self.norm = torch.nn.LayerNorm(8)

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        if self.device_mesh is None:  # a DDP-style strategy: nothing to parallelize
            return
        tp, dp = self.device_mesh["tensor_parallel"], self.device_mesh["data_parallel"]
        if tp.size() > 1:
            parallelize_module(self, tp, {"emb": RowwiseParallel(input_layouts=Replicate()),
                                          "head": ColwiseParallel(output_layouts=Replicate())})
            self.head.weight = self.emb.weight
        if dp.size() > 1:
            fully_shard(self, mesh=dp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.emb(x)))

    def training_step(self, batch, batch_idx):
        return self(batch[0]).logsumexp(-1).mean()

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.1)

    def train_dataloader(self):
        x = torch.randint(0, 16, (16, 3), generator=torch.Generator().manual_seed(1))
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x), batch_size=4)


def _options(steps, callbacks=()):
    return dict(accelerator="cpu", max_steps=steps, logger=False, callbacks=list(callbacks), enable_checkpointing=False,
                enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)


def _full(t):
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


class _Seen(pl.Callback):
    """What the restore left, at train start: the tie, the weights whole, the optimizer state."""

    def on_train_start(self, trainer, module):
        opt = trainer.optimizers[0]
        state = opt.state.get(module.emb.weight, {})
        self.got = {"tie": module.head.weight is module.emb.weight, "emb": _full(module.emb.weight),
                    "params": len(opt.param_groups[0]["params"]), "states": len(opt.state),
                    "exp_avg": _full(state["exp_avg"]) if "exp_avg" in state else None, "step": trainer.global_step}


def _stock_checkpoints(root):
    """A stock (one-process) Trainer's .ckpt, the same with the tie stored once (``head.weight`` dropped, as
    Hugging Face saves it), and with a genuinely missing key too; plus what the stock run ended with."""
    model = Tied()
    trainer = pl.Trainer(devices=1, **_options(2))
    trainer.fit(model)
    paths = {name: os.path.join(root, f"{name}.ckpt") for name in ("both", "once", "missing")}
    trainer.save_checkpoint(paths["both"])
    ckpt = torch.load(paths["both"], weights_only=False)
    ckpt["state_dict"].pop("head.weight")
    torch.save(ckpt, paths["once"])
    ckpt["state_dict"].pop("norm.bias")
    torch.save(ckpt, paths["missing"])
    state = trainer.optimizers[0].state[model.emb.weight]
    return paths, {"emb": model.emb.weight.detach().clone(), "exp_avg": state["exp_avg"].clone()}


def _outcome(fit):
    try:
        return ("ok", fit())
    except Exception as e:  # the kind and the text, checked by the test
        return (type(e).__name__, str(e))


def mp_main(dp, tp, ckpt_dir, out):
    """Every rank: resume each checkpoint of ``ckpt_dir`` under DistCheckpointModelParallelStrategy (DP x TP),
    and a save of its own; each outcome to ``out/rank<r>.pt``."""
    from lightning_distckpt.lightning import DistCheckpointModelParallelStrategy

    def fit(ckpt_path, steps=3, save=None):
        seen = _Seen()
        strategy = DistCheckpointModelParallelStrategy(data_parallel_size=dp, tensor_parallel_size=tp)
        trainer = pl.Trainer(devices=2, strategy=strategy, **_options(steps, [seen]))
        trainer.fit(Tied(), ckpt_path=ckpt_path)
        if save:
            trainer.save_checkpoint(save)
        return seen.got

    own = os.path.join(out, "own")
    results = {name: _outcome(lambda: fit(os.path.join(ckpt_dir, f"{name}.ckpt"), save=own if name == "once" else None))
               for name in ("once", "missing")}
    results["own"] = _outcome(lambda: fit(own, steps=4))
    torch.save(results, os.path.join(out, f"rank{torch.distributed.get_rank()}.pt"))


@pytest.fixture(scope="module")
def stock(tmp_path_factory):
    return _stock_checkpoints(str(tmp_path_factory.mktemp("tied_stock")))


def _same_weights(got, want):
    return torch.equal(got["emb"], want["emb"]) and torch.equal(got["exp_avg"], want["exp_avg"])


@pytest.mark.parametrize("dp, tp", [(1, 2), (2, 1)], ids=["tp2", "fsdp2"])
def test_model_parallel_resumes_a_tie_stored_once(stock, tmp_path, dp, tp):
    from script_ranks import run_ranks, script_env

    paths, want = stock
    code, output = run_ranks(__file__, ["mp", str(dp), str(tp), os.path.dirname(paths["once"]), str(tmp_path)],
                             script_env(), 2, timeout=300)
    assert code == 0, output[-4000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for res in ranks:
        kind, got = res["once"]
        assert kind == "ok", got
        assert got["tie"] and got["params"] == 3 and got["states"] == 3 and got["step"] == 2  # emb (=head), norm x2
        assert _same_weights(got, want)
        kind, text = res["missing"]
        assert kind == "MissingKeysError" and "norm.bias" in text and "head.weight" not in text, (kind, text)
        kind, again = res["own"]  # our own save of the resumed run (both names stored) resumes too
        assert kind == "ok", again
        assert again["tie"] and again["states"] == 3 and again["step"] == 3
    assert torch.equal(ranks[0]["own"][1]["emb"], ranks[1]["own"][1]["emb"])


def test_distcheckpointstrategy_resumes_a_tie_stored_once(stock, tmp_path, isolated_process_group):
    """One process: the .ckpt storing the tie once, and the same imported as a checkpoint directory."""
    from lightning_distckpt.export import from_torch_file
    from lightning_distckpt.lightning import DistCheckpointStrategy

    paths, want = stock
    imported = str(tmp_path / "imported")
    from_torch_file(paths["once"], imported)
    for path in (paths["once"], imported):
        seen = _Seen()
        pl.Trainer(devices=1, strategy=DistCheckpointStrategy(), **_options(3, [seen])).fit(Tied(), ckpt_path=path)
        assert seen.got["tie"] and seen.got["states"] == 3 and _same_weights(seen.got, want), path
    with pytest.raises(Exception, match="norm.bias") as err:
        pl.Trainer(devices=1, strategy=DistCheckpointStrategy(), **_options(3)).fit(Tied(), ckpt_path=paths["missing"])
    assert "head.weight" not in str(err.value)


if __name__ == "__main__" and sys.argv[1:2] == ["mp"]:
    mp_main(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5])
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
