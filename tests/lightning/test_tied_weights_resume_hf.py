"""Tied weights (one Parameter under two names) through Fabric's strategies, the DDP plugin, DistCheckpointStrategy
on 2 processes, and real Hugging Face models (GPT-2, Llama, ``tie_word_embeddings=True``): the tie kept (one
Parameter, its optimizer state once), values bit-exact on every rank, a tie stored once accepted and a genuinely
missing key refused by name. Run as a script (``MODE WORLD DIR OUT``), one process per rank (tests/script_ranks.py).
The shapes and the stock checkpoints are those of test_tied_weights_resume.py."""

import os
import sys

import lightning.pytorch as pl
import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_tied_weights_resume import Tied, _Seen, _options, _outcome, _stock_checkpoints  # noqa: E402


class TiedNet(torch.nn.Module):
    """Tied's layers as a plain module, for Fabric."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(16, 8)
        self.head = torch.nn.Linear(8, 16, bias=False)
        self.head.weight = self.emb.weight
        self.norm = torch.nn.LayerNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.emb(x)))


def _batches(n):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 16, (4, 3), generator=g) for _ in range(n)]


def _fabric_seen(net, opt):
    state = opt.state.get(net.emb.weight, {})
    return {"tie": net.head.weight is net.emb.weight, "emb": net.emb.weight.detach().clone(),
            "params": len(opt.param_groups[0]["params"]), "states": len(opt.state),
            "exp_avg": state["exp_avg"].clone() if "exp_avg" in state else None}


def fabric_main(world, root, out):
    """Every rank: train TiedNet 2 steps under FabricDistCheckpointStrategy, save ours and (rank 0) a stock Fabric
    file (both names, the tie once, a missing key too); load each into a fresh module and optimizer."""
    from lightning.fabric import Fabric

    from lightning_distckpt.lightning import FabricDistCheckpointStrategy

    fabric = Fabric(accelerator="cpu", devices=world, strategy=FabricDistCheckpointStrategy())
    fabric.launch()
    net = TiedNet()
    model, opt = fabric.setup(net, torch.optim.Adam(net.parameters(), lr=0.1))
    for x in _batches(2):
        opt.zero_grad()
        fabric.backward(model(x).logsumexp(-1).mean())
        opt.step()
    want = _fabric_seen(net, opt)
    ours = os.path.join(root, "fabric_ours")
    fabric.save(ours, {"model": model, "optimizer": opt, "step": 2})
    files = {n: os.path.join(root, f"fabric_{n}.pt") for n in ("both", "once", "missing")}
    if fabric.global_rank == 0:
        sd = {"model": net.state_dict(), "optimizer": opt.state_dict(), "step": 2}
        torch.save(sd, files["both"])
        sd["model"].pop("head.weight")
        torch.save(sd, files["once"])
        sd["model"].pop("norm.bias")
        torch.save(sd, files["missing"])
    fabric.barrier()

    def load(path):
        fresh = TiedNet()
        m, o = fabric.setup(fresh, torch.optim.Adam(fresh.parameters(), lr=0.1))
        fabric.load(path, {"model": m, "optimizer": o})
        return _fabric_seen(fresh, o)

    results = {name: _outcome(lambda: load(path)) for name, path in [("ours", ours), *files.items()]}
    torch.save({"want": want, "results": results}, os.path.join(out, f"rank{fabric.global_rank}.pt"))


def trainer_main(world, root, out):
    """Every rank: the stock checkpoints (made by the test) resumed under DDP + DistCheckpointIO and under
    DistCheckpointStrategy on ``world`` processes, and each's own save resumed."""
    from lightning_distckpt.lightning import DistCheckpointIO, DistCheckpointStrategy

    def fit(kind, ckpt_path, steps=3, save=None):
        seen = _Seen()
        if kind == "plugin":
            extra = dict(strategy="ddp", plugins=[DistCheckpointIO()])
        else:
            extra = dict(strategy=DistCheckpointStrategy())
        trainer = pl.Trainer(devices=world, **extra, **_options(steps, [seen]))
        trainer.fit(Tied(), ckpt_path=ckpt_path)
        if save:
            trainer.save_checkpoint(save)
        return seen.got

    results = {}
    for kind in ("plugin", "strategy"):
        own = os.path.join(root, f"own_{kind}")
        # The plugin under stock DDP hands the file to Lightning's own strict load_state_dict, which does not know
        # of ties: a tie stored once is refused there as under TorchCheckpointIO (see the report: not ours to fill).
        for name in (("once", "missing") if kind == "strategy" else ("both",)):
            results[kind, name] = _outcome(lambda: fit(kind, os.path.join(root, f"{name}.ckpt"),
                                                       save=own if name in ("once", "both") else None))
        results[kind, "own"] = _outcome(lambda: fit(kind, own, steps=4))
    torch.save(results, os.path.join(out, f"rank{torch.distributed.get_rank()}.pt"))


def _ranks(mode, world, root, out, timeout=300):
    from script_ranks import run_ranks, script_env

    code, output = run_ranks(__file__, [mode, str(world), str(root), str(out)], script_env(), world, timeout=timeout)
    assert code == 0, output[-4000:]
    return [torch.load(os.path.join(out, f"rank{r}.pt"), weights_only=False) for r in range(world)]


def _same(got, want):
    return torch.equal(got["emb"], want["emb"]) and torch.equal(got["exp_avg"], want["exp_avg"])


@pytest.mark.parametrize("world", [1, 2])
def test_fabric_keeps_a_tie(tmp_path, world):
    out = tmp_path / "out"
    out.mkdir()
    ranks = _ranks("fabric", world, tmp_path, out)
    for res in ranks:
        want = ranks[0]["want"]
        for name in ("ours", "both", "once"):
            kind, got = res["results"][name]
            assert kind == "ok", (name, got)
            assert got["tie"] and got["params"] == 3 and got["states"] == 3, (name, got)
            assert _same(got, want), name
        kind, text = res["results"]["missing"]
        assert kind == "MissingKeysError" and "norm.bias" in text and "head.weight" not in text, (kind, text)


@pytest.mark.long  # CI time: test_tied_saved_once_lightning.py resumes ties through both on 2 ranks by default
def test_ddp_plugin_and_strategy_keep_a_tie_on_two_processes(tmp_path):
    paths, want = _stock_checkpoints(str(tmp_path))
    out = tmp_path / "out"
    out.mkdir()
    ranks = _ranks("trainer", 2, tmp_path, out)
    for res in ranks:
        for kind, name in (("plugin", "both"), ("strategy", "once")):
            status, got = res[kind, name]
            assert status == "ok", (kind, got)
            assert got["tie"] and got["params"] == 3 and got["states"] == 3 and got["step"] == 2, (kind, got)
            assert _same(got, want), kind
        status, text = res["strategy", "missing"]
        assert status == "MissingKeysError" and "norm.bias" in text and "head.weight" not in text, text
        assert "Unexpected keys (not found in the checkpoint)" in text and "to skip them" in text  # Megatron's + a hint
        for kind in ("plugin", "strategy"):
            status, again = res[kind, "own"]
            assert status == "ok", (kind, again)
            assert again["tie"] and again["states"] == 3 and again["step"] == 3, (kind, again)
    for kind in ("plugin", "strategy"):
        assert torch.equal(ranks[0][kind, "own"][1]["emb"], ranks[1][kind, "own"][1]["emb"])


def _parallelize(net, mesh):
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    parallelize_module(net, mesh["tensor_parallel"], {"emb": RowwiseParallel(input_layouts=Replicate()),
                                                      "head": ColwiseParallel(output_layouts=Replicate())})
    net.head.weight = net.emb.weight
    return net


def fabric_mp_main(world, root, out):
    """Every rank: TiedNet at TP ``world`` under FabricDistCheckpointModelParallelStrategy, saved and loaded into a
    fresh module and optimizer."""
    from lightning.fabric import Fabric

    from lightning_distckpt.lightning import FabricDistCheckpointModelParallelStrategy

    fabric = Fabric(accelerator="cpu", devices=world, strategy=FabricDistCheckpointModelParallelStrategy(
        _parallelize, data_parallel_size=1, tensor_parallel_size=world))
    fabric.launch()

    def setup():
        net = fabric.setup_module(TiedNet())
        return net, fabric.setup_optimizers(torch.optim.Adam(net.parameters(), lr=0.1))

    def seen(net, opt):
        got = _fabric_seen(net, opt)
        got["emb"] = _full(net.emb.weight)
        got["exp_avg"] = _full(opt.state[net.emb.weight]["exp_avg"]) if net.emb.weight in opt.state else None
        return got

    model, opt = setup()
    for x in _batches(2):
        opt.zero_grad()
        fabric.backward(model(x).logsumexp(-1).mean())
        opt.step()
    want = seen(model.module if hasattr(model, "module") else model, opt)
    path = os.path.join(root, "fabric_mp")
    fabric.save(path, {"model": model, "optimizer": opt})

    def load():
        m, o = setup()
        fabric.load(path, {"model": m, "optimizer": o})
        return seen(m.module if hasattr(m, "module") else m, o)

    torch.save({"want": want, "results": {"ours": _outcome(load)}}, os.path.join(out, f"rank{fabric.global_rank}.pt"))


def test_fabric_model_parallel_keeps_a_tie(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    for res in _ranks("fabric_mp", 2, tmp_path, out):
        kind, got = res["results"]["ours"]
        assert kind == "ok", got
        assert got["tie"] and got["params"] == 3 and got["states"] == 3, got
        assert _same(got, res["want"])


def _hf_model(arch):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if arch == "gpt2":
        return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2,
                                          tie_word_embeddings=True))
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                        tie_word_embeddings=True))


class HFModule(pl.LightningModule):
    """A Hugging Face causal LM with its embedding tied to ``lm_head``; ``hf``: a folder to take the weights
    from in ``configure_model`` (strictly); under TP 2 the Llama's embedding and head are sharded by vocabulary
    and its MLPs column / row parallel, then the tie made again."""

    def __init__(self, arch: str, hf: str = "") -> None:
        super().__init__()
        self.model, self.hf = _hf_model(arch), hf

    def configure_model(self) -> None:
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        from lightning_distckpt.lightning import load_module_weights

        if self.hf:
            load_module_weights(self.model, self.hf, strict=True)
        if self.device_mesh is None or self.device_mesh["tensor_parallel"].size() == 1:
            return
        plan = {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
                "lm_head": ColwiseParallel(output_layouts=Replicate())}
        for i in range(len(self.model.model.layers)):
            plan.update({f"model.layers.{i}.mlp.gate_proj": ColwiseParallel(),
                         f"model.layers.{i}.mlp.up_proj": ColwiseParallel(),
                         f"model.layers.{i}.mlp.down_proj": RowwiseParallel()})
        parallelize_module(self.model, self.device_mesh["tensor_parallel"], plan)
        self.model.lm_head.weight = self.model.model.embed_tokens.weight

    def training_step(self, batch, batch_idx):
        return self.model(input_ids=batch[0], labels=batch[0]).loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.01)

    def train_dataloader(self):
        x = torch.randint(0, 64, (8, 6), generator=torch.Generator().manual_seed(1))
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x), batch_size=2)


class _HFSeen(pl.Callback):
    def on_train_start(self, trainer, module):
        emb = module.model.get_input_embeddings().weight
        opt = trainer.optimizers[0]
        state = opt.state.get(emb, {})
        self.got = {"tie": module.model.get_output_embeddings().weight is emb, "emb": _full(emb),
                    "params": len(opt.param_groups[0]["params"]), "distinct": len({id(p) for p in module.parameters()}),
                    "states": len(opt.state), "step": trainer.global_step,
                    "exp_avg": _full(state["exp_avg"]) if "exp_avg" in state else None}


def _full(t):
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def hf_main(world, root, out):
    """Every rank: GPT-2 and Llama (tied) trained 2 steps, saved, resumed under the plugin, DistCheckpointStrategy
    and (Llama) the ModelParallel strategy at TP 2; and a start from a Hugging Face folder storing the tie once."""
    from lightning_distckpt.lightning import (DistCheckpointIO, DistCheckpointModelParallelStrategy,
                                              DistCheckpointStrategy)

    def strategy(kind):
        if kind == "plugin":
            return dict(strategy="ddp", plugins=[DistCheckpointIO()])
        if kind == "tp2":
            return dict(strategy=DistCheckpointModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=2))
        return dict(strategy=DistCheckpointStrategy())

    def fit(arch, kind, steps, ckpt_path=None, save=None, hf=""):
        seen = _HFSeen()
        trainer = pl.Trainer(devices=world, **strategy(kind), **_options(steps, [seen]))
        module = HFModule(arch, hf)
        trainer.fit(module, ckpt_path=ckpt_path)
        if save:
            trainer.save_checkpoint(save)
        seen.got["end"] = _full(module.model.get_input_embeddings().weight)
        return seen.got

    rank = int(os.environ["LOCAL_RANK"])  # no process group before the first Trainer
    hf_dir = os.path.join(root, f"hf_llama_{rank}")  # one each (the same bytes): no rank waits on another's
    _hf_model("llama").save_pretrained(hf_dir)  # the tie stored once
    results = {}
    for arch, kind in (("gpt2", "plugin"), ("gpt2", "strategy"), ("llama", "strategy"), ("llama", "tp2")):
        own = os.path.join(root, f"{arch}_{kind}")
        results[arch, kind, "save"] = _outcome(lambda: fit(arch, kind, 2, save=own))
        results[arch, kind, "resume"] = _outcome(lambda: fit(arch, kind, 3, ckpt_path=own))
    for kind in ("strategy", "tp2"):
        results["hf", kind] = _outcome(lambda: fit("llama", kind, 1, hf=hf_dir))
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))


@pytest.mark.long
def test_hugging_face_tied_models_resume(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    ranks = _ranks("hf", 2, tmp_path, out, timeout=900)
    want_hf = _hf_model("llama").model.embed_tokens.weight.detach()
    for res in ranks:
        for arch, kind in (("gpt2", "plugin"), ("gpt2", "strategy"), ("llama", "strategy"), ("llama", "tp2")):
            status, saved = res[arch, kind, "save"]
            assert status == "ok", (arch, kind, saved)
            status, got = res[arch, kind, "resume"]
            assert status == "ok", (arch, kind, got)
            assert got["tie"] and got["step"] == 2 and got["states"] == got["distinct"], (arch, kind, got)
            assert torch.equal(got["emb"], saved["end"]), (arch, kind)
        for kind in ("strategy", "tp2"):
            status, got = res["hf", kind]
            assert status == "ok", (kind, got)
            assert got["tie"] and torch.equal(got["emb"], want_hf), kind
    for key in ranks[0]:
        assert torch.equal(ranks[0][key][1]["end"], ranks[1][key][1]["end"]), key


if __name__ == "__main__" and len(sys.argv) > 1:
    main = {"fabric": fabric_main, "trainer": trainer_main, "hf": hf_main, "fabric_mp": fabric_mp_main}[sys.argv[1]]
    main(int(sys.argv[2]), sys.argv[3], sys.argv[4])
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
