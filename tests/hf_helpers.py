"""A tiny Hugging Face model built locally (no download), for tests that read or write HF directories."""

import torch


def tiny_llama():
    """A 2-layer Llama of a few KB of weights, the same every call (seeded)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    return LlamaForCausalLM(config)
