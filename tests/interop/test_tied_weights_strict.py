"""Tied weights saved once (a Hugging Face tied embedding), loaded strictly by every loader: the name the
file lacks is filled from its twin and the tie kept; an untied missing name is still refused; a file holding
both tied names with different values is refused (one tensor cannot keep both)."""

import os

import pytest
import safetensors.torch
import torch

from dist_utils import run_distributed

GROUP_TIMEOUT_S = 30
TIED = ("lm_head.weight", "transformer.wte.weight")


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2, tie_word_embeddings=True)
    return GPT2LMHeadModel(config)


def _fresh():
    model = _gpt2()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    return model


def _folders(root):
    """hf: save_pretrained (the embedding once); untied_missing: a non-tied key dropped too; clash: both
    tied names, different values."""
    model = _gpt2()
    hf = os.path.join(root, "hf")
    model.save_pretrained(hf)
    stored = safetensors.torch.load_file(os.path.join(hf, "model.safetensors"))
    assert ("lm_head.weight" in stored) != ("transformer.wte.weight" in stored)  # saved once
    out = {"hf": hf}
    for name, edit in (("untied_missing", lambda sd: sd.pop("transformer.ln_f.bias")),
                       ("clash", lambda sd: sd.update({TIED[0]: model.transformer.wte.weight.detach() + 1,
                                                       TIED[1]: model.transformer.wte.weight.detach().clone()}))):
        sd = dict(stored)
        edit(sd)
        folder = os.path.join(root, name)
        os.makedirs(folder)
        tensors = {k: v.contiguous() for k, v in sd.items()}
        safetensors.torch.save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
        out[name] = folder
    return out


def _check(model):
    """The tie kept, both names holding the saved embedding."""
    want = _gpt2().transformer.wte.weight
    return (model.lm_head.weight is model.transformer.wte.weight
            and torch.equal(model.lm_head.weight.detach(), want.detach())
            and torch.equal(model.transformer.ln_f.bias.detach(), _gpt2().transformer.ln_f.bias.detach()))


def _outcome(load):
    try:
        return ("ok", load())
    except Exception as e:  # the kind and the text, compared in the test
        return (type(e).__name__, str(e))


def _dist_module(folder):
    from lightning_distckpt.ingest import DistModule, load_state_dict

    model = DistModule(_fresh())
    model.load_state_dict(load_state_dict(folder), strict=True)
    return _check(model.module)


def _module_weights(folder):
    from lightning_distckpt.lightning.inference import load_module_weights

    return _check(load_module_weights(_fresh(), folder, strict=True))


def _ldc_load(folder):
    import lightning_distckpt as ldc
    from lightning_distckpt.lightning import module_sharded_state_dict

    model = _fresh()
    state = ldc.load(module_sharded_state_dict(model), folder, strict="raise_all")
    model.load_state_dict(state, strict=True)
    same = state[TIED[0]] is state[TIED[1]] or torch.equal(state[TIED[0]], state[TIED[1]])
    return same and _check(model)


LOADERS = {"DistModule": _dist_module, "load_module_weights": _module_weights, "ldc.load": _ldc_load}


def _every_loader(rank, world, folders):
    return {(loader, name): _outcome(lambda: fn(folder))
            for loader, fn in LOADERS.items() for name, folder in folders.items()}


@pytest.mark.parametrize("world", [1, 2])
def test_tied_embedding_saved_once_loads_strictly(tmp_path, world):
    folders = _folders(str(tmp_path))
    for rank_result in run_distributed(_every_loader, world, folders, timeout_s=GROUP_TIMEOUT_S):
        for loader in LOADERS:
            # old: the twin refused as missing / unexpected by every strict loader
            assert rank_result[(loader, "hf")] == ("ok", True), (loader, rank_result[(loader, "hf")])
            kind, text = rank_result[(loader, "untied_missing")]
            assert kind == "MissingKeysError" and "transformer.ln_f.bias" in text, (loader, kind, text)
            kind, text = rank_result[(loader, "clash")]
            # old: the last read silently won (ldc.load, load_module_weights) or the tie was dropped (DistModule)
            assert kind == "ValidationError" and "tied" in text and TIED[0] in text, (loader, kind, text)
            assert "Timeout" not in text and "timed out" not in text


def test_parts_of_one_buffer_under_several_keys_are_no_tie():
    """One buffer cut into parts under several keys (another part of a global tensor each, or another flat
    range) is no tie: only keys naming the same part of the same tensor are grouped."""
    import lightning_distckpt as ldc
    from lightning_distckpt.reading.tied import tie_groups

    buf, flat = torch.zeros(4), torch.zeros(2)
    parts = [ldc.ShardedTensor("a", buf, buf.dtype, (4,), (8,), (0,)),
             ldc.ShardedTensor("b", buf, buf.dtype, (4,), (8,), (4,)),
             ldc.ShardedTensor("c", buf, buf.dtype, (4,), (8,), (0,)),  # a's part: tied to a
             ldc.ShardedTensor("d", flat, flat.dtype, (4,), (8,), (0,), flattened_range=slice(0, 2)),
             ldc.ShardedTensor("e", flat, flat.dtype, (4,), (8,), (0,), flattened_range=slice(2, 4))]
    assert tie_groups(parts, [id(buf)] * 3 + [id(flat)] * 2) == [[0, 2]]
