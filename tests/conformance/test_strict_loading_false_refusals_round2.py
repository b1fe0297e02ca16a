"""More hunting for false refusals by Lightning's strict loading under DistCheckpointStrategy (round 2): modules whose
state dicts hold non-persistent buffers, extra state (a tensor, a dict holding a tensor), tied weights, a
``torch.compile``d submodule, or a ``sharded_state_dict`` that leaves out a frozen parameter.

One real 2-rank run (forked as torchrun would start them) saves each module with stock DDP (a ``.ckpt`` file) and
with our strategy, then resumes (``fit``) and tests (``test(ckpt_path=...)``) it under stock DDP from the stock file
and under ours from both. Where stock restores, ours restores the same values; where ours cannot restore what stock
does (the read leaves a stored tensor unread: a parameter its sharded_state_dict leaves out), it refuses, on every
rank, naming the tensors and why.
"""


import pytest

from script_ranks import agreed_outcomes

RUNS = r'''import json, os, sys, warnings
warnings.filterwarnings("ignore")
import torch
from torch import nn
from torch.utils.data import DataLoader
from lightning.pytorch import Trainer, LightningModule
from lightning.pytorch.strategies import DDPStrategy
from lightning_distckpt.lightning import DistCheckpointStrategy
from lightning_distckpt.lightning.parallel import module_sharded_state_dict, parallel_state_of

class M(LightningModule):
    def __init__(self, v="plain", extra=False):
        super().__init__()
        torch.manual_seed(0)
        self.v = v
        self.fc = nn.Linear(4, 4)
        if extra:
            self.norm = nn.LayerNorm(4)
        if v == "nonpersist":
            self.register_buffer("scratch", torch.ones(3), persistent=False)
        if v == "tied":
            self.emb = nn.Embedding(5, 4)
            self.head = nn.Linear(4, 5, bias=False)
            self.head.weight = self.emb.weight
        if v == "compiled":
            self.sub = torch.compile(nn.Linear(4, 4))
        if v == "frozen_out":
            self.frozen = nn.Linear(4, 4)
            self.frozen.requires_grad_(False)
    def get_extra_state(self):
        if self.v == "xs_tensor":
            return getattr(self, "xs_t", torch.zeros(3))
        if self.v == "xs_dict":
            return {"n": 3, "t": getattr(self, "xs_t", torch.zeros(3))}
        return None
    def set_extra_state(self, s):
        self.got_extra = s
    def forward(self, x):
        return self.fc(x)
    def training_step(self, b, i):
        self.xs_t = torch.arange(3.0) + 7
        # every trainable parameter in the graph: DDP then averages each step's gradients on every rank
        return self(b).sum() + 0 * sum(p.sum() for p in self.parameters() if p.requires_grad)
    def test_step(self, b, i):
        pass
    def predict_step(self, b, i):
        return self(b)
    def validation_step(self, b, i):
        pass
    def _dl(self):
        return DataLoader(torch.randn(8, 4), batch_size=2)
    train_dataloader = test_dataloader = val_dataloader = predict_dataloader = _dl
    def configure_optimizers(self):
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.1)

# no get_extra_state override for non-xs variants: nn.Module checks type(self).get_extra_state is Module's
class Plain(M):
    get_extra_state = nn.Module.get_extra_state
    set_extra_state = nn.Module.set_extra_state

class FrozenOut(Plain):
    def sharded_state_dict(self, prefix=""):
        sd = module_sharded_state_dict(self, prefix, replica_id=parallel_state_of(self).replicated_id)
        return {k: v for k, v in sd.items() if not k.startswith(prefix + "frozen.")}

def make(v, extra=False):
    if v.startswith("xs_"):
        return M(v, extra)
    if v == "frozen_out":
        return FrozenOut(v, extra)
    return Plain(v, extra)

from script_ranks import outcome, write_outcomes

root, out = sys.argv[1], sys.argv[2]
cases = sys.argv[3].split(",")
res = {}
def trainer(strategy, steps=1):
    return Trainer(accelerator="cpu", devices=2, max_steps=steps, logger=False, enable_progress_bar=False,
                   enable_model_summary=False, enable_checkpointing=False, default_root_dir=root, strategy=strategy)
S = {"stock": DDPStrategy, "ours": DistCheckpointStrategy}
for v in cases:
    for kind, strat in S.items():
        ck = os.path.join(root, f"{v}_{kind}.ckpt")
        def save():
            t = trainer(strat()); m = make(v); t.fit(m); t.save_checkpoint(ck)
        res[f"{v}/{kind}/save"] = outcome(save)
    for kind in ("ours", "stock"):
        for saver in ("stock", "ours") if kind == "ours" else ("stock",):
            ck = os.path.join(root, f"{v}_{saver}.ckpt")
            for how in ("fit", "test"):
                def run():
                    m = make(v); t = trainer(S[kind](), 2)
                    (t.fit if how == "fit" else t.test)(m, ckpt_path=ck)
                    sd = {k: v.tolist() for k, v in m.state_dict().items() if isinstance(v, torch.Tensor)}
                    return {"extra": repr(getattr(m, "got_extra", None)), "sd": sd}
                res[f"{v}/{kind}<-{saver}/{how}"] = outcome(run)
write_outcomes(out, res)
'''


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every rank's outcome of each save / resume pair (one 2-rank run serves every test here)."""
    import lightning_distckpt
    print("lightning_distckpt from", lightning_distckpt.__file__)
    cases = "nonpersist,xs_tensor,xs_dict,tied,compiled,frozen_out"
    return agreed_outcomes(str(tmp_path_factory.mktemp("runs")), RUNS, cases)


@pytest.mark.parametrize("how", ["fit", "test"])
@pytest.mark.parametrize("saver", ["stock", "ours"])
@pytest.mark.parametrize("case", ["nonpersist", "xs_tensor", "tied", "compiled"])
def test_resumes_and_restores_as_stock(runs, case, saver, how):
    """Non-persistent buffers, a tensor extra state, tied weights, a compiled submodule: a strict resume / test under
    ours, from stock's .ckpt or our own checkpoint, passes and restores the values stock DDP restores (weights and
    extra state)."""
    assert runs[f"{case}/stock/save"] == {"type": None} and runs[f"{case}/ours/save"] == {"type": None}
    stock = runs[f"{case}/stock<-stock/{how}"]
    assert stock["type"] is None, stock
    ours = runs[f"{case}/ours<-{saver}/{how}"]
    assert ours == stock, (ours, stock)


@pytest.mark.parametrize("how", ["fit", "test"])
def test_a_frozen_parameter_left_out_of_sharded_state_dict_is_refused_clearly(runs, how):
    """A stock .ckpt resumed by a module whose sharded_state_dict leaves out a frozen Linear its state_dict has:
    stock loads the stored frozen weights; ours does not read them, so it refuses, naming the stored keys, the
    module's names, and what to do (before: a meta placeholder was copied into the parameters, torch's
    'Cannot copy out of meta tensor' on every rank)."""
    assert runs["frozen_out/stock<-stock/" + how]["type"] is None
    ours = runs["frozen_out/ours<-stock/" + how]
    assert ours["type"] == "MissingKeysError", ours
    msg = ours["message"]
    assert "['state_dict/frozen.bias', 'state_dict/frozen.weight'] were not read" in msg, msg
    assert "FrozenOut.sharded_state_dict() leaves out ['frozen.bias', 'frozen.weight']" in msg, msg
    assert "meta" not in msg, msg


@pytest.mark.parametrize("how", ["fit", "test"])
def test_a_dict_extra_state_tensor_of_a_stock_file_is_restored_as_stock(runs, how):
    """A stock .ckpt whose module extra state is a dict holding a tensor: stock restores the tensor; a strict resume
    under ours reads the stored 'state_dict/_extra_state/t' into its place and restores it as stock (before: refused
    as unread); our own checkpoint of the same module alike (tests/conformance/test_extra_state_from_stock_files.py)."""
    stock = runs["xs_dict/stock<-stock/" + how]
    assert stock["type"] is None, stock
    assert runs["xs_dict/ours<-ours/" + how] == stock
    assert runs["xs_dict/ours<-stock/" + how] == stock
