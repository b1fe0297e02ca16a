"""``load_module_weights`` from ordinary files: a ``torch.save`` state dict or Lightning ``.ckpt``,
a ``.safetensors`` file, a Hugging Face directory made locally by ``transformers``
(``save_pretrained(..., max_shard_size=...)``, nothing downloaded); in one process, and under TP 2
on 2 gloo processes where each rank reads its own shards without any collective."""


import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import lightning_distckpt as ldc
from dist_utils import run_distributed
from lightning_distckpt.lightning import ParallelState
from lightning_distckpt.lightning.parallel import module_sharded_state_dict
from example_layers import ColumnParallelLinear, RowParallelLinear  # examples/tp_layers.py

transformers = pytest.importorskip("transformers")


def _llama(seed: int) -> "transformers.LlamaForCausalLM":
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config)


def _same(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_hf_directory_and_safetensors_into_a_whole_module(tmp_path):
    src = _llama(0)
    hf = tmp_path / "hf"
    src.save_pretrained(hf, max_shard_size="40KB")
    assert (hf / "model.safetensors.index.json").is_file() and len(list(hf.glob("*.safetensors"))) > 1
    dst = _llama(1)
    assert not _same(src, dst)
    assert ldc.lightning.load_module_weights(dst, hf) is dst and _same(src, dst)
    single = tmp_path / "w.safetensors"
    save_file({k: v.contiguous() for k, v in src.state_dict().items()}, str(single))
    dst = _llama(2)
    ldc.lightning.load_module_weights(dst, single)
    assert _same(src, dst)


def test_torch_file_and_lightning_ckpt(tmp_path):
    src = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    torch.save(src.state_dict(), tmp_path / "sd.pt")
    torch.save({"state_dict": src.state_dict(), "epoch": 3,
                "optimizer_states": [{"state": {0: {"exp_avg": torch.ones(8, 4)}}, "param_groups": []}]},
               tmp_path / "stock.ckpt")
    for name in ("sd.pt", "stock.ckpt"):  # a Lightning .ckpt: "state_dict/<name>", the rest skipped
        dst = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
        ldc.lightning.load_module_weights(dst, tmp_path / name)
        assert _same(src, dst)


def test_strict_names_what_is_missing_or_unused(tmp_path):
    src = nn.Sequential(nn.Linear(4, 8))
    save_file(src.state_dict(), str(tmp_path / "w.safetensors"))
    bigger = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    with pytest.raises(ldc.MissingKeysError, match="1.weight"):
        ldc.lightning.load_module_weights(bigger, tmp_path / "w.safetensors")
    ldc.lightning.load_module_weights(bigger, tmp_path / "w.safetensors", strict=False)
    assert torch.equal(bigger[0].weight, src[0].weight)
    with pytest.raises(ldc.CheckpointingError, match="0.bias"):  # a file tensor nothing takes
        ldc.lightning.load_module_weights(nn.Sequential(nn.Linear(4, 8, bias=False)), tmp_path / "w.safetensors")


class TPMLP(nn.Module):
    """Llama's MLP of layer 0, tensor-parallel: up_proj column-parallel, down_proj row-parallel."""

    def __init__(self, ps: ParallelState) -> None:
        super().__init__()
        self.ps = ps
        self.up = ColumnParallelLinear(32, 64, ps, bias=False)
        self.down = RowParallelLinear(64, 32, ps, bias=False)

    def sharded_state_dict(self, prefix: str = ""):
        return module_sharded_state_dict(self, prefix, replica_id=self.ps.replicated_id)


HF_NAMES = {"model.layers.0.mlp.up_proj.weight": "up.weight", "model.layers.0.mlp.down_proj.weight": "down.weight"}


def _tp_load(rank, world, path):
    ps = ParallelState.build(tensor_parallel_size=world)
    net = TPMLP(ps)
    ldc.lightning.load_module_weights(net, path, key_map=HF_NAMES.get)  # None: every other tensor of the file skipped
    return {"up": net.up.weight.detach().clone(), "down": net.down.weight.detach().clone()}


@pytest.mark.parametrize("kind", ["hf", "safetensors"])
def test_tensor_parallel_shards_from_hf_directory(tmp_path, kind):
    src = _llama(0)
    if kind == "hf":
        path = tmp_path / "hf"
        src.save_pretrained(path, max_shard_size="40KB")
    else:
        path = tmp_path / "w.safetensors"
        save_file({k: v.contiguous() for k, v in src.state_dict().items()}, str(path))
    up = src.model.layers[0].mlp.up_proj.weight.detach()
    down = src.model.layers[0].mlp.down_proj.weight.detach()
    out = run_distributed(_tp_load, 2, str(path))
    for rank, got in enumerate(out):
        assert torch.equal(got["up"], up.chunk(2, dim=0)[rank])  # bit-exact: this rank's rows
        assert torch.equal(got["down"], down.chunk(2, dim=1)[rank])  # and columns
