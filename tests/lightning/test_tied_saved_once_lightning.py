"""Tied weights written once (format 8) through the Lightning strategies and the tiers, for real: 2 gloo
processes, a module whose embedding (1024 x 64 fp32: 256 KiB, 128 KiB a rank when split by vocabulary rows, so
above planning/aliases.TIE_MIN_BYTES on every rank) is the output layer's weight.

Each save must store the tie once (metadata.json ``aliases``, format 8) and each resume keep it: one Parameter,
values and optimizer state bit-exact, every rank alike. Covered: DistCheckpointStrategy, stock DDP with the
DistCheckpointIO plugin (a rank-0-only save), a weights-only restore into an untied module (strict and not),
DistCheckpointModelParallelStrategy with TP 2 and with FSDP2 resumed at the same and at the other mesh, and the
tiers (node-local and partner copies: the local copy stores the tie once and a restore from it, and from a
partner after one node's copy is gone, is exact).

Every case runs by default (about 25 s on 2 cores). Hang guard: every group's timeout (GROUP_TIMEOUT_S); a rank
left waiting records a CollectiveError, told apart from the outcomes asserted.
"""

import pytest

from tier_parity_scripts import AGREED, run_trainer_script

RANKS = r"""import hashlib
import json
import shutil
from datetime import timedelta

import lightning.pytorch as pl
import torch
import torch.distributed as dist

from lightning_distckpt.lightning import DistCheckpointIO
from tier_parity_scripts import GROUP_TIMEOUT_S, Recorder, dist_strategy, full, tier_config

folder, out, SCENARIO = sys.argv[1:4]
record = Recorder(out, rank)
VOCAB, DIM = 1024, 64


class Tied(pl.LightningModule):
    '''``head(norm(emb(x)))``; tied: ``head.weight`` is the embedding's Parameter (re-tied after tensor
    parallelism, which gives each module its own DTensor). ``extra``: one more layer, not in any checkpoint.'''

    def __init__(self, tied=True, extra=False, strict=True):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(VOCAB, DIM)
        self.head = torch.nn.Linear(DIM, VOCAB, bias=False)
        if tied:
            self.head.weight = self.emb.weight
        self.norm = torch.nn.LayerNorm(DIM)
        if extra:
            self.extra = torch.nn.Linear(DIM, DIM)
        self.tied, self.strict_loading = tied, strict

    def configure_model(self):
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        if self.device_mesh is None:
            return
        tp, dp = self.device_mesh["tensor_parallel"], self.device_mesh["data_parallel"]
        if tp.size() > 1:
            parallelize_module(self, tp, {"emb": RowwiseParallel(input_layouts=Replicate()),
                                          "head": ColwiseParallel(output_layouts=Replicate())})
            if self.tied:
                self.head.weight = self.emb.weight
        if dp.size() > 1:
            fully_shard(self, mesh=dp)

    def forward(self, x):
        return self.head(self.norm(self.emb(x)))

    def training_step(self, batch, batch_idx):
        x = torch.randint(0, VOCAB, (4, 3), generator=torch.Generator().manual_seed(self.global_step))
        return self(x).logsumexp(-1).mean()

    def validation_step(self, batch, batch_idx):
        pass

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(list(range(64)), batch_size=1)

    def val_dataloader(self):
        return torch.utils.data.DataLoader(list(range(1)), batch_size=1)


def digest(t):
    return hashlib.sha256(full(t).contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


def state(trainer, module):
    '''The tie, the weights whole, the embedding's optimizer state (hashes), what the optimizer holds.'''
    opt = trainer.optimizers[0] if trainer.optimizers else None
    st = opt.state.get(module.emb.weight, {}) if opt is not None else {}
    return {"tie": module.head.weight is module.emb.weight, "emb": digest(module.emb.weight),
            "head": digest(module.head.weight), "norm": digest(module.norm.weight),
            "exp_avg": digest(st["exp_avg"]) if "exp_avg" in st else None,
            "exp_avg_sq": digest(st["exp_avg_sq"]) if "exp_avg_sq" in st else None,
            "states": len(opt.state) if opt is not None else None, "step": trainer.global_step}


class Seen(pl.Callback):
    got = None

    def on_train_start(self, trainer, module):
        self.got = state(trainer, module)
        point = None
        for cb in trainer.callbacks:
            lt = getattr(cb, "local_tier", None)
            if lt is not None and lt.last_point is not None:
                point = [lt.last_point.step, lt.last_point.source]
        self.got["point"] = point

    def on_validation_start(self, trainer, module):
        self.got = state(trainer, module)


def trainer(strategy, steps, seen=None, **kw):
    return pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=steps, logger=False,
                      callbacks=[seen] if seen else [], enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, num_sanity_val_steps=0, use_distributed_sampler=False,
                      default_root_dir=folder, **kw)


def meta(path):
    with open(os.path.join(path, "metadata.json")) as f:
        m = json.load(f)
    return {"format": m["format_version"], "aliases": {k: v["target"] for k, v in (m.get("aliases") or {}).items()}}


def train_and_save(strategy_fn, path, steps=2, **model_kw):
    t, model = trainer(strategy_fn(), steps), Tied(**model_kw)
    t.fit(model)
    if path:
        t.save_checkpoint(path)
    return {"end": state(t, model), **({"meta": meta(path)} if path else {})}


def resume(strategy_fn, path, steps=3, end=False, **model_kw):
    seen, model = Seen(), Tied(**model_kw)
    t = trainer(strategy_fn(), steps, seen)
    t.fit(model, ckpt_path=path)
    return {**seen.got, "end": state(t, model)} if end else seen.got


def validate(strategy_fn, path, **model_kw):
    seen = Seen()
    trainer(strategy_fn(), 1, seen).validate(Tied(**model_kw), ckpt_path=path)
    return seen.got


def mp(dp, tp):
    from lightning_distckpt.lightning import DistCheckpointModelParallelStrategy

    return lambda: DistCheckpointModelParallelStrategy(data_parallel_size=dp, tensor_parallel_size=tp,
                                                       timeout=timedelta(seconds=GROUP_TIMEOUT_S))


def barrier_then(fn):
    dist.barrier()
    if rank == 0:
        fn()
    dist.barrier()


if SCENARIO == "ddp":
    ddp = lambda: dist_strategy("ddp")  # noqa: E731
    ck = os.path.join(folder, "ddp.ckpt")
    record("ddp save", lambda: train_and_save(ddp, ck))
    record("ddp resume", lambda: resume(ddp, ck))
    record("ddp untied strict", lambda: validate(ddp, ck, tied=False))
    record("ddp untied extra strict", lambda: validate(ddp, ck, tied=False, extra=True))
    record("ddp untied extra lax", lambda: validate(ddp, ck, tied=False, extra=True, strict=False))
    plugin = lambda: pl.strategies.DDPStrategy(checkpoint_io=DistCheckpointIO(),  # noqa: E731
                                               timeout=timedelta(seconds=GROUP_TIMEOUT_S))
    pk = os.path.join(folder, "plugin.ckpt")
    record("plugin save", lambda: train_and_save(plugin, pk))
    record("plugin resume", lambda: resume(plugin, pk))
elif SCENARIO == "mp":
    for name, (dp, tp) in (("tp2", (1, 2)), ("fsdp2", (2, 1))):
        record(f"{name} save", lambda: train_and_save(mp(dp, tp), os.path.join(folder, name)))
    for saved in ("tp2", "fsdp2"):
        for name, (dp, tp) in (("tp2", (1, 2)), ("fsdp2", (2, 1))):
            record(f"{saved} into {name}", lambda: resume(mp(dp, tp), os.path.join(folder, saved)))
elif SCENARIO == "fabric":
    from lightning.fabric import Fabric

    from lightning_distckpt.lightning.fabric_model_parallel import FabricDistCheckpointModelParallelStrategy

    def parallelize(model, mesh):  # Tied's own parallelization, as the Trainer's strategy runs it
        model._device_mesh = mesh
        model.configure_model()
        return model

    def fabric_run(dp, tp, path, load):
        fabric = Fabric(accelerator="cpu", devices=2, strategy=FabricDistCheckpointModelParallelStrategy(
            parallelize, data_parallel_size=dp, tensor_parallel_size=tp, timeout=timedelta(seconds=GROUP_TIMEOUT_S)))
        fabric.launch()
        module = fabric.setup_module(Tied())
        opt = fabric.setup_optimizers(torch.optim.Adam(module.parameters(), lr=0.1))
        inner = module.module
        if load:
            fabric.load(path, {"model": module, "optimizer": opt})
        else:
            for step in range(2):
                x = torch.randint(0, VOCAB, (4, 3), generator=torch.Generator().manual_seed(step))
                fabric.backward(module(x).logsumexp(-1).mean())
                opt.step()
                opt.zero_grad()
            fabric.save(path, {"model": module, "optimizer": opt})
        st = opt.state.get(inner.emb.weight, {})
        got = {"tie": inner.head.weight is inner.emb.weight, "emb": digest(inner.emb.weight),
               "norm": digest(inner.norm.weight), "exp_avg": digest(st["exp_avg"]),
               "exp_avg_sq": digest(st["exp_avg_sq"]), "states": len(opt.state)}
        return {"end": got, **({} if load else {"meta": meta(path)})}

    for name, (dp, tp) in (("tp2", (1, 2)), ("fsdp2", (2, 1))):
        record(f"{name} save", lambda: fabric_run(dp, tp, os.path.join(folder, "f" + name), False))
    for saved in ("tp2", "fsdp2"):
        for name, (dp, tp) in (("tp2", (1, 2)), ("fsdp2", (2, 1))):
            record(f"{saved} into {name}", lambda: fabric_run(dp, tp, os.path.join(folder, "f" + saved), True)["end"])
elif SCENARIO == "tiers":
    root = os.path.join(folder, "tiers")
    tiers = lambda: dist_strategy("ddp", tier_config(root))  # noqa: E731
    record("tiers run", lambda: train_and_save(tiers, None, steps=3))

    def local_meta():
        out = {}
        for d, _, files in os.walk(os.path.join(root, "local")):
            if "metadata.json" in files:
                out[os.path.relpath(d, root)] = meta(d)
        return out

    record("tiers local meta", local_meta)
    record("tiers local resume", lambda: resume(tiers, "last", steps=4, end=True))  # saves local step 4
    barrier_then(lambda: shutil.rmtree(os.path.join(root, "local", "node0")))
    record("tiers partner resume", lambda: resume(tiers, "last", steps=5))
"""


def _run(tmp_path_factory, scenario):
    return run_trainer_script(tmp_path_factory.mktemp(f"tied_{scenario}"), RANKS, [scenario], agreed=AGREED)


@pytest.fixture(scope="module")
def ddp(tmp_path_factory):
    return _run(tmp_path_factory, "ddp")


def _same(got, want, tie=True):
    keys = ("emb", "exp_avg", "exp_avg_sq", "norm") if want.get("exp_avg") else ("emb", "norm")
    return got["tie"] == tie and all(got[k] == want[k] for k in keys)


def test_distcheckpointstrategy_stores_the_tie_once_and_resumes_it(ddp):
    for res in ddp:
        kind, saved = res["ddp save"]
        assert kind == "ok", saved
        assert saved["meta"] == {"format": 8, "aliases": {"head.weight": "emb.weight"}}
        kind, got = res["ddp resume"]
        assert kind == "ok", got
        assert _same(got, saved["end"]) and got["states"] == 3 and got["step"] == 2 and got["head"] == got["emb"]
    assert ddp[0]["ddp resume"] == ddp[1]["ddp resume"]


def test_distcheckpointstrategy_restores_a_stored_tie_into_an_untied_module(ddp):
    for res in ddp:
        want = res["ddp save"][1]["end"]
        kind, got = res["ddp untied strict"]
        assert kind == "ok", got
        assert not got["tie"] and got["emb"] == got["head"] == want["emb"]  # the alias served to both names
        kind, text = res["ddp untied extra strict"]
        assert kind == "MissingKeysError" and "extra" in text and "head.weight" not in text, (kind, text)
        kind, got = res["ddp untied extra lax"]
        assert kind == "ok", got
        assert not got["tie"] and got["emb"] == got["head"] == want["emb"]


def test_stock_ddp_plugin_stores_the_tie_once_and_resumes_it(ddp):
    for res in ddp:
        kind, saved = res["plugin save"]
        assert kind == "ok", saved
        assert saved["meta"] == {"format": 8, "aliases": {"state_dict/head.weight": "state_dict/emb.weight"}}
        kind, got = res["plugin resume"]
        assert kind == "ok", got
        assert _same(got, saved["end"]) and got["states"] == 3 and got["step"] == 2
    assert ddp[0]["plugin resume"] == ddp[1]["plugin resume"]


def test_model_parallel_tp2_and_fsdp2_store_the_tie_once_and_reshard(tmp_path_factory):
    res = _run(tmp_path_factory, "mp")
    for r in res:
        for saved in ("tp2", "fsdp2"):
            kind, got = r[f"{saved} save"]
            assert kind == "ok", got
            assert got["meta"] == {"format": 8, "aliases": {"state_dict/head.weight": "state_dict/emb.weight"}}
            for into in ("tp2", "fsdp2"):
                kind, back = r[f"{saved} into {into}"]
                assert kind == "ok", (saved, into, back)
                assert _same(back, got["end"]) and back["states"] == 3 and back["step"] == 2, (saved, into)
    for key in res[0]:
        assert res[0][key] == res[1][key], key


def test_tiers_store_the_tie_once_locally_and_restore_it_from_a_partner(tmp_path_factory):
    res = _run(tmp_path_factory, "tiers")
    for r in res:
        kind, run = r["tiers run"]
        assert kind == "ok", run
        kind, metas = r["tiers local meta"]
        assert kind == "ok" and metas, metas
        assert all(m == {"format": 8, "aliases": {"head.weight": "emb.weight"}} for m in metas.values()), metas
        kind, got = r["tiers local resume"]
        assert kind == "ok", got
        assert _same(got, run["end"]) and got["step"] == 3 and got["point"] == [3, "local"], got
        kind, again = r["tiers partner resume"]  # node 0's copies gone: step 4 from node 1's partner copy
        assert kind == "ok", again
        assert _same(again, got["end"]) and again["step"] == 4 and again["point"] == [4, "local"], again
    assert res[0]["tiers partner resume"] == res[1]["tiers partner resume"]


def test_fabric_model_parallel_stores_the_tie_once_and_reshards(tmp_path_factory):
    res = _run(tmp_path_factory, "fabric")
    for r in res:
        for saved in ("tp2", "fsdp2"):
            kind, got = r[f"{saved} save"]
            assert kind == "ok", got
            assert got["meta"] == {"format": 8, "aliases": {"model/head.weight": "model/emb.weight"}}
            for into in ("tp2", "fsdp2"):
                kind, back = r[f"{saved} into {into}"]
                assert kind == "ok", (saved, into, back)
                assert _same(back, got["end"]) and back["states"] == 3, (saved, into, back, got["end"])
    for key in res[0]:
        assert res[0][key] == res[1][key], key
