"""A module's extra state holding tuples (and other containers) restores exactly, types included, as stock does.

``get_extra_state()`` may return any picklable value: ``{"step": 3, "pair": (tensor, 7), "nested": [(1, 2),
{"t": (tensor,)}]}``, a tuple at the top, a namedtuple, sets, empty tuples, a tuple that grew since the module was
built, a container whose kind changed (a list then, a tuple now). Stock Lightning (``torch.save`` /
``torch.load`` of the checkpoint dict) hands ``set_extra_state`` exactly the stored value.

Was, reading a stock file (a Trainer ``.ckpt``, ``fabric.save``'s file) under DistCheckpointStrategy (TP 1, TP 2)
or FabricDistCheckpointStrategy: the file's tensors inside tuples were named by their path
(``state_dict/body.top._extra_state/0``) but had no place in the restore's tree (a tuple is common state as a
whole), so a strict resume refused the module's extra state as missing and ``strict_loading = False`` handed
``set_extra_state`` ``None`` in the tensors' places or the fresh module's value (silently wrong). A namedtuple
became a plain tuple in every checkpoint our strategies wrote, and reading one from a stock file raised
``TypeError: NT.__new__() missing ...``. Now a stock file's tuples stay whole in the common state, tensors and all
(as our strategies save them), and every walk that rebuilds a tuple keeps its type, or refuses one it cannot make
again naming its place.

The order of each dict's keys is compared too. A dict holding tensors before other values came back with its
tensors' entries last (or first: the checkpoint keeps the tensors apart from the common state and puts them back
by path), where stock keeps the saved order; now the manifest keeps that order, and a stock file gives its own.

One real 2-rank run per group of kinds (forked as torchrun would start them): saves with stock DDP, our strategy
and the plugin, then restores each way beside stock DDP restoring the stock file, strict and not; Fabric likewise.
"""

import collections

import pytest
import torch

from script_ranks import agreed_outcomes

RUNS = r'''import collections, json, os, sys, warnings
warnings.filterwarnings("ignore")
import torch
from torch import nn
from torch.utils.data import DataLoader
from lightning.fabric import Fabric
from lightning.fabric.strategies import DDPStrategy as FabricDDP
from lightning.pytorch import Trainer, LightningModule
from lightning.pytorch.strategies import DDPStrategy
from lightning_distckpt.lightning import DistCheckpointIO, DistCheckpointStrategy, FabricDistCheckpointStrategy
from lightning_distckpt.lightning.parallel import module_sharded_state_dict, parallel_state_of
from script_ranks import write_outcomes

NT = collections.namedtuple("NT", ["a", "b"])
torch.serialization.add_safe_globals([NT, set, frozenset])  # what a user of these types does for stock too

def value(kind, n):
    """The extra state of kind ``kind`` after step ``n`` (0: a fresh module's)."""
    g = torch.Generator().manual_seed(n)
    r = lambda *s: torch.randn(*s, generator=g)
    if kind == "mixed":
        return {"step": n, "pair": (r(3), 7), "nested": [(1, 2), {"t": (r(2),)}], "e": (), "el": [()]}
    if kind == "top":  # a tuple at the top, a float64 tensor in a nested tuple
        return (r(2), n, (r(1).double(), "x"))
    if kind == "only_tensors":  # a tuple of tensors alone (nothing of it is common state in a stock file)
        return (r(3),)
    if kind == "grown":  # one more tensor per step
        return {"g": tuple(r(2) for _ in range(n + 1))}
    if kind == "list_then_tuple":
        return {"x": [r(2)]} if n == 0 else {"x": (r(2), r(2))}
    if kind == "tuple_then_list":
        return {"x": (r(2),)} if n == 0 else {"x": [r(2), r(2)]}
    if kind == "tuple_then_dict":
        return (r(2),) if n == 0 else {"a": r(2), "b": [r(1)]}
    if kind == "dict_then_tuple":
        return {"a": r(2), "b": [r(1)]} if n == 0 else (r(2), 5)
    if kind == "none_then_tuple":
        return None if n == 0 else (r(2),)
    if kind == "empty_top":
        return (r(1),) if n == 0 else ()
    if kind == "tuple_of_lists":  # lists and dicts of tensors inside a tuple
        return (r(2), [r(3), {"k": r(1)}], {"d": (r(1), [r(1)])})
    if kind == "tuple_keys":  # a tuple as a dict key, tuples in a list
        return {(1, "a"): r(2), "l": [(r(1), 2)]}
    if kind == "sets":
        return {"s": {1, 2, n}, "f": frozenset({n}), "t": r(2)}
    if kind == "namedtuple":
        return {"nt": NT(r(2), n), "in_list": [NT((r(1), NT(n, r(1))), "x")], "top": (NT(r(1), ()),)}
    raise ValueError(kind)

KINDS = sys.argv[3].split(",")

class XS(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.kind, self.n = kind, 0
        self.lin = nn.Linear(2, 2)
    def get_extra_state(self):
        return value(self.kind, self.n)
    def set_extra_state(self, s):
        self.got = s

class Body(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        for k in KINDS:
            setattr(self, k, XS(k))
    def bump(self, i):
        for k in KINDS:
            getattr(self, k).n = i
    def got(self):
        return {k: show(getattr(getattr(self, k), "got", "NOT SET")) for k in KINDS}

class FM(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = Body()

class M(LightningModule):
    def __init__(self, lenient=False):
        super().__init__()
        self.body = Body()
        self.strict_loading = not lenient
    def training_step(self, b, i):
        self.body.bump(i + 1)
        return sum(getattr(self.body, k).lin(b).sum() for k in KINDS)
    def train_dataloader(self):
        return DataLoader(torch.randn(8, 2), batch_size=2)
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

class TP(M):
    def sharded_state_dict(self, prefix=""):
        return module_sharded_state_dict(self, prefix, replica_id=parallel_state_of(self).replicated_id)

def show(x):
    """``x`` as JSON keeping what an exact restore keeps: each container's type, each tensor's dtype and bits."""
    if isinstance(x, torch.Tensor):
        ints = {torch.float64: torch.int64, torch.float32: torch.int32}
        return {"tensor": str(x.dtype), "bits": (x.view(ints[x.dtype]) if x.is_floating_point() else x).tolist()}
    if isinstance(x, dict):  # in its order: a dict's key order is compared too (module docstring)
        return {"dict": [[show(k), show(v)] for k, v in x.items()]}
    if isinstance(x, (list, tuple)):
        return {type(x).__name__: [show(v) for v in x]}
    if isinstance(x, (set, frozenset)):
        return {type(x).__name__: sorted(x)}
    return x

def outcome(call):
    try:
        return {"type": None, "got": call()}
    except Exception as e:
        return {"type": type(e).__name__, "message": str(e)[:800]}

root, out = sys.argv[1], sys.argv[2]
res = {"lightning_distckpt": __import__("lightning_distckpt").__file__}
def trainer(strategy, plugin=False):
    return Trainer(accelerator="cpu", devices=2, max_steps=3, logger=False, enable_progress_bar=False,
                   enable_model_summary=False, enable_checkpointing=False, default_root_dir=root, strategy=strategy,
                   plugins=[DistCheckpointIO()] if plugin else None)
SAVERS = {"stock": (DDPStrategy, False), "ours": (DistCheckpointStrategy, False), "plugin": (DDPStrategy, True)}
RESUMERS = {**SAVERS, "ours_tp2": (lambda: DistCheckpointStrategy(tensor_parallel_size=2), False)}
for saver, (strategy, plugin) in SAVERS.items():
    t = trainer(strategy(), plugin); t.fit(M()); t.save_checkpoint(os.path.join(root, f"{saver}.ckpt"))
    res[f"saved_by_{saver}"] = {k: show(getattr(t.lightning_module.body, k).get_extra_state()) for k in KINDS}
for resumer, (strategy, plugin) in RESUMERS.items():
    for saver in SAVERS:
        if resumer == "stock" and saver != "stock":
            continue
        for lenient in (False, True):
            def resume():
                m = (TP if resumer == "ours_tp2" else M)(lenient)
                trainer(strategy(), plugin).fit(m, ckpt_path=os.path.join(root, f"{saver}.ckpt"))
                return m.body.got()
            res[f"{resumer}<-{saver}/{'lenient' if lenient else 'strict'}"] = outcome(resume)
for writer, strategy in {"stock": FabricDDP, "ours": FabricDistCheckpointStrategy}.items():
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy())
    fabric.launch()
    model = FM(); model.body.bump(3)
    fabric.save(os.path.join(root, f"fabric_{writer}"), {"model": fabric.setup_module(model)})
for reader, strategy in {"stock": FabricDDP, "ours": FabricDistCheckpointStrategy}.items():
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy())
    fabric.launch()
    for saved in ("fabric_stock", "fabric_ours", "stock.ckpt"):
        if reader == "stock" and saved != "fabric_stock":
            continue
        for strict in (True, False):
            def load():
                model = FM()
                fabric.load(os.path.join(root, saved), {"model": fabric.setup_module(model)}, strict=strict)
                return model.body.got()
            res[f"fabric_{reader}<-{saved}/{'strict' if strict else 'lenient'}"] = outcome(load)
write_outcomes(out, res)
'''

GROUPS = {
    "containers": ["mixed", "top", "only_tensors", "grown", "list_then_tuple", "tuple_then_list", "tuple_then_dict",
                   "dict_then_tuple", "none_then_tuple", "empty_top", "tuple_of_lists", "tuple_keys", "sets"],
    "namedtuple": ["namedtuple"],
}


@pytest.fixture(scope="module", params=sorted(GROUPS))
def runs(request, tmp_path_factory):
    """Every save / restore pair's outcome (rank 0's, checked equal to rank 1's) for one group of kinds."""
    res = agreed_outcomes(str(tmp_path_factory.mktemp(request.param)), RUNS, ",".join(GROUPS[request.param]))
    print("lightning_distckpt from", res.pop("lightning_distckpt"))
    return res


def _differences(got, want):
    """The kinds whose restored value differs from ``want``'s, with both (or the error instead)."""
    if got["type"] is not None:
        return got
    return {k: {"want": want["got"][k], "got": got["got"][k]} for k in want["got"] if got["got"][k] != want["got"][k]}


def _types(shown):
    """Every container type name in a shown value (``show``'s keys)."""
    if isinstance(shown, dict):
        return set(k for k in shown if k not in ("tensor", "bits")) | {t for v in shown.values() for t in _types(v)}
    if isinstance(shown, list):
        return {t for v in shown for t in _types(v)}
    return set()


def test_stock_restores_what_every_saver_stored(runs):
    """What the tests below compare to: stock DDP resuming its own file hands set_extra_state the stored value
    (the grown one, not a fresh module's), which holds the containers under test; every saver stored the same."""
    saved = runs["saved_by_stock"]
    assert runs["saved_by_ours"] == saved == runs["saved_by_plugin"]
    for mode in ("strict", "lenient"):
        assert runs[f"stock<-stock/{mode}"] == {"type": None, "got": saved}, runs[f"stock<-stock/{mode}"]
    kinds = _types(saved)
    assert "tuple" in kinds and ("NT" in kinds or {"set", "frozenset"} <= kinds), kinds


@pytest.mark.parametrize("mode", ["strict", "lenient"])
@pytest.mark.parametrize("pair", ["ours<-stock", "ours_tp2<-stock", "plugin<-stock", "ours<-ours", "ours_tp2<-ours",
                                  "plugin<-ours", "ours<-plugin", "ours_tp2<-plugin", "plugin<-plugin"])
def test_a_trainer_resume_restores_extra_state_containers_as_stock(runs, pair, mode):
    """Every resume (our strategy TP 1 and 2, the plugin) of every saver's checkpoint hands set_extra_state the
    stored value exactly: tuples stay tuples (a namedtuple that namedtuple), tensors bit-exact. Was, for a stock
    file under our strategy: strict refused the extra state as missing, lenient gave None in the tensors' places
    or the fresh value; every checkpoint ours wrote gave a namedtuple back as a plain tuple."""
    stock = runs[f"stock<-stock/{mode}"]
    assert _differences(runs[f"{pair}/{mode}"], stock) == {}


@pytest.mark.parametrize("mode", ["strict", "lenient"])
@pytest.mark.parametrize("saved", ["fabric_stock", "fabric_ours", "stock.ckpt"])
def test_a_fabric_load_restores_extra_state_containers_as_stock(runs, saved, mode):
    """fabric.load into FabricDistCheckpointStrategy of stock Fabric's file, ours, and a stock Trainer .ckpt (its
    state_dict into the module): the stored value exactly, as stock Fabric loads its own file."""
    stock = runs[f"fabric_stock<-fabric_stock/{mode}"]
    assert stock["type"] is None, stock
    want = {"type": None, "got": runs["saved_by_stock"]} if saved == "stock.ckpt" else stock
    assert _differences(runs[f"fabric_ours<-{saved}/{mode}"], want) == {}


# -- the walks that rebuild tuples (one process) -------------------------------------------------------------
NT = collections.namedtuple("NT", ["a", "b"])


class Pair(tuple):
    """A tuple subclass that cannot be made from its items (its constructor takes two arguments)."""

    def __new__(cls, a, b):
        return super().__new__(cls, (a, b))


def test_rebuilt_tuples_keep_their_type():
    """A walk that copies a tree (map_leaves) or replaces its leaves (replace_leaves) gives back a namedtuple as
    that namedtuple and a torch.return_types value as its type (was: plain tuples)."""
    from lightning_distckpt.core.state_dict import map_leaves, replace_leaves

    top = torch.max(torch.tensor([[1.0, 3.0]]), dim=1)
    for walk in (lambda t: map_leaves(lambda x: x * 2 if isinstance(x, torch.Tensor) else x, t),
                 lambda t: replace_leaves(t, lambda x: x * 2 if isinstance(x, torch.Tensor) else x)):
        out = walk({"nt": NT(torch.ones(1), [NT(2, torch.zeros(1))]), "max": top})
        assert type(out["nt"]) is NT and type(out["nt"].b[0]) is NT and out["nt"].b[0].a == 2
        assert torch.equal(out["nt"].a, torch.full((1,), 2.0))
        assert type(out["max"]) is type(top) and torch.equal(out["max"].values, top.values * 2)


def test_a_tuple_subclass_that_cannot_be_rebuilt_is_refused_naming_its_place():
    """A tuple subclass whose constructor does not take its items, with a leaf to replace: a clear error naming
    its place and type, never a plain tuple in its stead (was: silently a plain tuple)."""
    from lightning_distckpt.core.errors import CheckpointingError
    from lightning_distckpt.core.state_dict import map_leaves

    with pytest.raises(CheckpointingError, match=r"at x/1: a .*Pair \(a tuple subclass\) cannot be made again"):
        map_leaves(lambda x: x + 1 if isinstance(x, torch.Tensor) else x, {"x": [0, Pair(torch.ones(1), 2)]})
    same = Pair(1, 2)
    assert map_leaves(lambda x: x, {"x": [same]})["x"][0] is same  # nothing replaced in it: kept as it is


@pytest.fixture
def nt_allowed():
    """NT allowed to unpickle for the test only (torch's process-wide list as it was after)."""
    before = torch.serialization.get_safe_globals()
    torch.serialization.add_safe_globals([NT])
    yield
    torch.serialization.clear_safe_globals()
    torch.serialization.add_safe_globals(before)


def test_a_torch_file_with_a_namedtuple_holding_a_tensor_reads(tmp_path, nt_allowed):
    """A torch.save file whose namedtuple holds a tensor: its common state keeps the namedtuple (the tensor,
    named by its path, in the tensors), as a plain tuple keeps its type (was: TypeError from NT.__new__)."""
    import lightning_distckpt as ldc

    path = str(tmp_path / "nt.pt")
    torch.save({"x": NT(torch.ones(2), 3), "w": torch.zeros(3)}, path)
    common = ldc.load_common_state_dict(path)
    assert type(common["x"]) is NT and common["x"].b == 3
    assert set(ldc.load_tensors_metadata(path)) == {"x/0", "w"}


def test_a_manifest_cannot_ask_for_a_tuple_to_be_made():
    """Tuples are never made from a manifest (a tuple is common state as a whole): a manifest path with a tuple
    step, at a huge position or not, is a FormatError naming the checkpoint, before anything is allocated."""
    from lightning_distckpt.core.errors import FormatError
    from lightning_distckpt.lightning.tree import manifest_paths

    for index in (0, 1 << 40):
        man = {"version": 1, "kind": "plain",
               "tensor_paths": [[[["d", "state_dict"], ["d", "m._extra_state"], ["t", index]], "k"]]}
        with pytest.raises(FormatError, match=r"checkpoint ckpt: .*tensor_paths"):
            manifest_paths(man, "ckpt")
