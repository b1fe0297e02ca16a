"""A safetensors file a reader opened is closed with the reader: no ``ResourceWarning: unclosed file`` (seen
under ``-W always`` in examples/finetune_llama_tp.py's ``load_module_weights``), whichever API read it."""

from __future__ import annotations

import gc
import warnings

import torch
from safetensors.torch import save_file

import lightning_distckpt as ldc
from lightning_distckpt.ingest import load_state_dict


def test_reading_a_safetensors_file_leaves_no_file_to_the_garbage_collector(tmp_path):
    path = str(tmp_path / "model.safetensors")
    save_file({"w": torch.arange(4.0), "b": torch.ones(2)}, path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plain = ldc.load_plain_tensors(path)
        ingested = load_state_dict(path)
        gc.collect()
    assert torch.equal(plain["w"], torch.arange(4.0)) and torch.equal(ingested["b"], torch.ones(2))
    unclosed = [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]
    assert unclosed == []
