"""Tiny random-weight models of each family, built from configs (no downloads)."""

from __future__ import annotations

import torch
from transformers import (AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config,
                          Qwen3Config)

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")

_CONFIGS = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config,
            "qwen3": Qwen3Config}


def tiny_config(family: str = "qwen2", vocab_size: int = 128, **overrides):
    kwargs = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=512, tie_word_embeddings=family == "qwen2",
                  eos_token_id=None, bos_token_id=None, pad_token_id=None)
    if family == "mistral":
        kwargs["sliding_window"] = None
    if family == "qwen3":
        kwargs["head_dim"] = 32
    kwargs.update(overrides)
    return _CONFIGS[family](**kwargs)


def tiny_model(family: str = "qwen2", seed: int = 0, dtype=torch.float32, **overrides):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, **overrides),
                                             attn_implementation="eager")
    # Random init with std 0.02 gives near-uniform logits; larger weights give the peaked,
    # repetitive distributions real models have, which exercises greedy parity harder.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
    return model.to(dtype).eval()


def char_tokenizer(alphabet: str = "abcdefghijklmnopqrstuvwxyz0123456789 +=.,\n"):
    """A character-level tokenizer built locally: ids 0..2 are <pad>, <bos>, <eos>."""
    from recipes.tiny import char_tokenizer as build

    return build(alphabet)
