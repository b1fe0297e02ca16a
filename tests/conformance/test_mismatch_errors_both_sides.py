"""Refusals that name what is wrong on both sides.

(a) A checkpoint whose keys do not match the module: stock Lightning (torch's ``load_state_dict``)
names the keys the module lacks *and* the ones the checkpoint lacks; so must ``DistCheckpointStrategy``,
``DistCheckpointIO`` and ``fabric.load``. Real 2-rank Trainer fits and Fabric runs (forked as torchrun
would start them), beside stock DDP on the same pairs: a renamed layer, an extra layer, a missing
layer, a submodule compiled on one side only.
(b) torch DCP's ``FileSystemWriter(serialization_format=SAFETENSORS, _extensions=[ZStandard()])``,
which torch's own reader cannot read back: refused naming the combination and what to do.
"""

import os
import re
import textwrap
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

import lightning_distckpt as ldc

from dcp_variant_writers import save_variant
from dist_utils import run_distributed
from script_ranks import agreed_outcomes

FITS = textwrap.dedent('''
    import json, os, sys, warnings
    warnings.filterwarnings("ignore")
    import torch
    from lightning.fabric import Fabric
    from lightning.pytorch import LightningModule, Trainer
    from lightning.pytorch.strategies import DDPStrategy
    from lightning_distckpt.lightning import DistCheckpointIO, DistCheckpointStrategy, FabricDistCheckpointStrategy

    class Net(LightningModule):
        """Linear(4, 4) layers applied in turn; ``compiled`` ones wrapped by torch.compile."""
        def __init__(self, names=("layer", "head"), compiled=()):
            super().__init__()
            self.names = names
            for n in names:
                lin = torch.nn.Linear(4, 4)
                setattr(self, n, torch.compile(lin, backend="eager") if n in compiled else lin)
        def forward(self, x):
            for n in self.names:
                x = getattr(self, n)(x)
            return x
        def training_step(self, batch, i):
            return self(batch).sum()
        def train_dataloader(self):
            return torch.utils.data.DataLoader(torch.randn(8, 4), batch_size=2)
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    VARIANTS = {"renamed": dict(names=("layer", "out")), "extra": dict(names=("layer", "head", "extra")),
                "missing": dict(names=("layer",)), "compiled": dict(compiled=("head",))}
    STRATEGIES = {"ours": lambda: DistCheckpointStrategy(),
                  "plugin": lambda: DDPStrategy(checkpoint_io=DistCheckpointIO()), "stock": lambda: DDPStrategy(),
                  "ours_raise_all": lambda: DistCheckpointStrategy(checkpoint={"strict": "raise_all"})}
    root, out = sys.argv[1], sys.argv[2]
    res = {}
    from script_ranks import write_outcomes

    def outcome(call):
        try:
            call()
            return {"type": None}
        except Exception as e:
            return {"type": type(e).__name__, "message": str(e)}
    for kind, strategy in STRATEGIES.items():
        ck = os.path.join(root, kind + ".ckpt")
        for name, kw in [("base", {}), *VARIANTS.items()]:
            t = Trainer(accelerator="cpu", devices=2, max_steps=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, default_root_dir=root,
                        strategy=strategy())
            res[kind + "/" + name] = outcome(lambda: t.fit(Net(**kw), ckpt_path=None if name == "base" else ck))
            if name == "base":
                t.save_checkpoint(ck)
    fabric = Fabric(accelerator="cpu", devices=2, strategy=FabricDistCheckpointStrategy())
    fabric.launch()
    ck = os.path.join(root, "fabric_ck")
    fabric.save(ck, {"model": fabric.setup_module(Net())})
    for name, kw in VARIANTS.items():
        model = fabric.setup_module(Net(**kw))
        res["fabric/" + name] = outcome(lambda: fabric.load(ck, {"model": model}))
    write_outcomes(out, res)
''')


@pytest.fixture(scope="module")
def fits(tmp_path_factory):
    """Every rank's outcome of each save-then-resume pair (the same run serves every test here)."""
    return agreed_outcomes(str(tmp_path_factory.mktemp("fits")), FITS)  # agreed on all ranks


def _ours(text: str, title: str) -> set:
    """The keys our message lists after ``title`` (Megatron-Core's words)."""
    found = re.search(re.escape(title) + r": \[([^\]]*)\]", text)
    return set() if found is None else set(re.findall(r"'([^']*)'", found.group(1)))


def _torchs(text: str, title: str) -> set:
    """The keys torch's ``load_state_dict`` error lists after ``title``."""
    found = re.search(re.escape(title) + r": ([^\n]*)", text)
    return set() if found is None else set(re.findall(r'"([^"]*)"', found.group(1)))


def _sides(outcome: dict, prefix: str = "") -> tuple:
    """(the checkpoint's keys the module lacks, the module's keys the checkpoint lacks) as our
    message names them; ``prefix`` (Fabric's state entry) taken off."""
    text = outcome["message"]
    cut = lambda keys: {k[len(prefix):] for k in keys}  # noqa: E731
    return cut(_ours(text, "Missing keys (for all ranks)")), cut(_ours(text, "Unexpected keys (of all ranks)"))


@pytest.mark.parametrize("case", ["renamed", "compiled"])
def test_a_renamed_or_compiled_layer_is_refused_naming_both_sides_as_stock_lightning_does(fits, case):
    """Before: only the module's keys (Megatron-Core's "unexpected"); now the checkpoint's keys the
    module lacks too, the same two sets stock DDP (torch's load_state_dict, opposite words) names,
    under the strategy and under fabric.load; the plugin gives torch's own error."""
    stock = fits[f"stock/{case}"]
    assert stock["type"] == "RuntimeError", stock
    theirs = (_torchs(stock["message"], "Unexpected key(s) in state_dict"),
              _torchs(stock["message"], "Missing key(s) in state_dict"))
    assert all(theirs), stock
    for kind, prefix in (("ours", ""), ("ours_raise_all", ""), ("fabric", "model.")):
        ours = fits[f"{kind}/{case}"]
        assert ours["type"] == "MissingKeysError", (kind, ours)
        assert _sides(ours, prefix) == theirs, (kind, ours["message"])
        assert "to skip them" in ours["message"] and "strict_loading = False" in ours["message"]  # hints kept
    assert fits[f"plugin/{case}"] == stock  # the plugin hands the dict to Lightning, which calls torch
    if case == "compiled":
        assert "'_orig_mod.' is what torch.compile adds" in fits["ours/compiled"]["message"]
    else:
        assert "python -m lightning_distckpt inspect" in fits["ours/renamed"]["message"]


def test_an_extra_layer_names_no_checkpoint_key_as_a_close_match(fits):
    """Before, fabric.load suggested the checkpoint's 'model.head.bias' "for" 'model.extra.bias' though
    the module asks for head.bias itself; now the message says every checkpoint key is asked for."""
    stock = fits["stock/extra"]
    want = _torchs(stock["message"], "Missing key(s) in state_dict")
    assert want == {"extra.weight", "extra.bias"}, stock
    for kind, prefix in (("ours", ""), ("ours_raise_all", ""), ("fabric", "model.")):
        ours = fits[f"{kind}/extra"]
        assert _sides(ours, prefix) == (set(), want), (kind, ours)
        assert "Every key of the checkpoint is asked for" in ours["message"], ours
        assert "Did you mean" not in ours["message"], ours
    assert fits["plugin/extra"] == stock


def test_a_missing_layer_is_refused_under_raise_all_naming_it(fits):
    """A module lacking a saved layer: stock refuses it; so do our default (the config's strict left
    unset: Lightning's strict_loading / fabric.load(strict=True) refuse a module's unused weights;
    before, Megatron-Core's assume_ok_unexpected resumed silently) and strict: raise_all, naming
    the same keys as stock."""
    stock = fits["stock/missing"]
    want = _torchs(stock["message"], "Unexpected key(s) in state_dict")
    assert want == {"head.weight", "head.bias"}, stock
    for kind, prefix in (("ours", ""), ("ours_raise_all", ""), ("fabric", "model.")):
        strict = fits[f"{kind}/missing"]
        assert strict["type"] == "MissingKeysError" and _sides(strict, prefix) == (want, set()), (kind, strict)
    assert fits["plugin/missing"] == stock


def test_long_key_lists_are_bounded(tmp_path):
    """Before: every key listed (a renamed prefix of a large model: thousands); now ten and a count."""
    ldc.save({f"old.{i:02d}": ldc.ShardedTensor.from_rank_offsets(f"old.{i:02d}", torch.ones(1)) for i in range(30)},
             tmp_path / "ck")
    template = {f"new.{i:02d}": ldc.ShardedTensor.from_rank_offsets(f"new.{i:02d}", torch.zeros(1)) for i in range(30)}
    with pytest.raises(ldc.MissingKeysError) as e:
        ldc.load(template, tmp_path / "ck")
    text = str(e.value)
    assert "Missing keys (for all ranks): ['old.00', " in text and "'old.09', ... (30 in all)]" in text, text
    assert "Unexpected keys (of all ranks): ['new.00', " in text and "'new.09', ... (30 in all)]" in text, text
    assert "'old.10'" not in text and "'new.10'" not in text


def _ranks_ask_differently(rank: int, world: int, path: str) -> dict:
    """Rank 0 asks for a and x, rank 1 for b and x; the checkpoint holds a, b and c."""
    mine = {"x": ldc.ShardedTensor.from_rank_offsets("x", torch.zeros(1), replica_id=rank),
            "ab"[rank]: ldc.ShardedTensor.from_rank_offsets("ab"[rank], torch.zeros(1))}
    out = {}
    for strict in ("assume_ok_unexpected", "raise_all"):
        try:
            ldc.load(mine, path, strict=strict)
            out[strict] = None
        except ldc.MissingKeysError as e:
            out[strict] = str(e)
    return out


def test_ranks_asking_for_different_keys_agree_on_the_refusal(tmp_path):
    """No collective is added: where the ranks ask for different keys, the default mode does not
    compare them, and says so (the same words on every rank); raise_all names the unasked one."""
    ldc.save({k: ldc.ShardedTensor.from_rank_offsets(k, torch.ones(1)) for k in "abc"}, tmp_path / "ck")
    first, second = run_distributed(_ranks_ask_differently, 2, str(tmp_path / "ck"))
    assert first == second
    assert "not listed: the ranks ask for different keys" in first["assume_ok_unexpected"]
    assert _ours(first["assume_ok_unexpected"], "Unexpected keys (of all ranks)") == {"x"}
    assert _ours(first["raise_all"], "Missing keys (for all ranks)") == {"c"}


def _save_compressed_safetensors(state: dict, path: str) -> None:
    from torch.distributed.checkpoint._extension import ZStandard
    from torch.distributed.checkpoint.filesystem import SerializationFormat

    writer = dcp.FileSystemWriter(path, serialization_format=SerializationFormat.SAFETENSORS,
                                  _extensions=[ZStandard()])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no_dist's deprecation note
        dcp.save(state, storage_writer=writer, no_dist=True)


@pytest.mark.parametrize("names", [("a", "b"), ("a",)])
def test_dcp_safetensors_with_zstandard_is_refused_naming_the_combination(tmp_path, names):
    """torch 2.13 writes each tensor as an empty zstd frame before an uncompressed safetensors file
    and cannot read it back itself. Before: "... overlap those of ... (.metadata forged or damaged)"
    with two tensors, with one a read error; now the combination and what to do instead."""
    state = {n: torch.arange(4.0 * (i + 1)) for i, n in enumerate(names)}
    path = str(tmp_path / "ck")
    _save_compressed_safetensors({**state, "step": {"n": 1}}, path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(BaseException):  # torch's own reader: a CheckpointException (a BaseException)
            dcp.load({n: torch.zeros_like(t) for n, t in state.items()},
                     storage_reader=dcp.FileSystemReader(path), no_dist=True)
    template = {n: ldc.ShardedTensor.from_rank_offsets(n, torch.zeros_like(t)) for n, t in state.items()}
    with pytest.raises(ldc.FormatError) as e:
        ldc.load(template, path)
    text = str(e.value)
    assert os.path.join(path, "__0_0.distcp") in text, text
    assert "FileSystemWriter(serialization_format=SerializationFormat.SAFETENSORS, _extensions=[ZStandard()])" in text
    assert "Re-save with serialization_format=TORCH_SAVE" in text and "overlap" not in text


def test_dcp_zstandard_and_safetensors_alone_still_load(tmp_path):
    """Each of the two alone (which torch reads back) is read as before."""
    state = {"a": torch.arange(6.0), "b": torch.arange(3, dtype=torch.int64)}
    for kind in ("zstd", "safetensors"):
        path = save_variant(dict(state), str(tmp_path / kind), kind)
        template = {k: ldc.ShardedTensor.from_rank_offsets(k, torch.zeros_like(v)) for k, v in state.items()}
        out = ldc.load(template, path)
        assert all(torch.equal(out[k], v) for k, v in state.items()), kind
