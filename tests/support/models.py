"""Tiny random-weight models of each family, built from configs (no downloads)."""

from __future__ import annotations

import torch
from transformers import (AutoModelForCausalLM, Gemma2Config, Gemma3TextConfig, LlamaConfig,
                          MistralConfig, MixtralConfig, Phi3Config, Qwen2Config, Qwen3Config,
                          Qwen3MoeConfig)

MOE = ("qwen3_moe", "mixtral")
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3", *MOE)
GEMMA = ("gemma2", "gemma3_text")

_CONFIGS = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config,
            "qwen3": Qwen3Config, "gemma2": Gemma2Config, "gemma3_text": Gemma3TextConfig,
            "phi3": Phi3Config, "qwen3_moe": Qwen3MoeConfig, "mixtral": MixtralConfig}
# Gemma: a sliding window shorter than most test prompts (so it matters), layers alternating
# sliding and global, soft-capping on, query_pre_attn_scalar != head_dim; Gemma 3 with its two
# RoPE bases, the global one linearly scaled.
_GEMMA = dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=8,
              final_logit_softcapping=5.0, layer_types=["sliding_attention", "full_attention"])
# MoE: top-2 of 8 experts, no shared expert; Qwen3-MoE with its top-k renormalised (the
# variant off is tested on its own), Mixtral's expert size smaller than the dense default.
_EXTRA = {
    "qwen3_moe": dict(head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48,
                      norm_topk_prob=True),
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=48,
                    sliding_window=None),
    "gemma2": dict(_GEMMA, attn_logit_softcapping=4.0),
    "gemma3_text": dict(_GEMMA, rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0}}),
}


def tiny_config(family: str = "qwen2", vocab_size: int = 128, **overrides):
    # max_position_embeddings: the engine refuses a max_model_len past it, and leaves 4096
    # (its default max_model_len) to the tests that set none.
    kwargs = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=4096, tie_word_embeddings=family == "qwen2",
                  eos_token_id=None, bos_token_id=None, pad_token_id=None)
    if family == "mistral":
        kwargs["sliding_window"] = None
    if family == "qwen3":
        kwargs["head_dim"] = 32
    kwargs.update(_EXTRA.get(family, {}))
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
            elif family in GEMMA:  # its RMSNorm weights are w - 1 (zeros at init)
                p.normal_(0, 0.1)
    return model.to(dtype).eval()


@torch.no_grad()
def always_picks(model, token: int):
    """Rig a tiny Llama-shaped model (untied head) so its greedy token is always `token`,
    whatever the context: the last hidden unit carries the embedding's 30 past every layer to
    the head. Returns the model."""
    d = model.config.hidden_size - 1
    for layer in model.model.layers:
        layer.self_attn.o_proj.weight[d] = 0
        layer.mlp.down_proj.weight[d] = 0
    model.model.embed_tokens.weight[:, d] = 30.0
    model.model.norm.weight.zero_()
    model.model.norm.weight[d] = 1.0
    model.lm_head.weight.zero_()
    model.lm_head.weight[token, d] = 10.0
    return model


def char_tokenizer(alphabet: str = "abcdefghijklmnopqrstuvwxyz0123456789 +=.,\n"):
    """A character-level tokenizer built locally: ids 0..2 are <pad>, <bos>, <eos>."""
    from rollout_recipes.run.tiny import char_tokenizer as build

    return build(alphabet)


def bos_chat_tokenizer(chat_template: str | None,
                       alphabet: str = "abcdefghijklmnopqrstuvwxyz0123456789 +=.,\n<>"):
    """char_tokenizer whose plain encodes prepend <bos>, as Llama's do, with `chat_template`: a
    template that writes the BOS itself shows up as a doubled BOS wherever its text is encoded
    with special tokens added."""
    from tokenizers.processors import TemplateProcessing

    tok = char_tokenizer(alphabet)
    tok.backend_tokenizer.post_processor = TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", tok.bos_token_id)])
    tok.chat_template = chat_template
    return tok


# Hub checkpoints name each expert's projections (transformers 5 models stack them): Qwen3-MoE
# `mlp.experts.<e>.{gate,up,down}_proj`, Mixtral `block_sparse_moe.experts.<e>.{w1,w3,w2}`.
_PER_EXPERT = {"qwen3_moe": (".mlp.", ("gate_proj", "up_proj", "down_proj")),
               "mixtral": (".block_sparse_moe.", ("w1", "w3", "w2"))}


def per_expert_tensors(model):
    """(name, tensor) of an MoE model as its Hub checkpoints name them: the stacked experts
    split into one tensor per expert and projection."""
    block, (gate, up, down) = _PER_EXPERT[model.config.model_type]
    for name, tensor in model.state_dict().items():
        name = name.replace(".mlp.", block)
        prefix, _, last = name.rpartition(".")
        if not prefix.endswith(".experts"):
            yield name, tensor
            continue
        for e, weight in enumerate(tensor):
            if last == "gate_up_proj":
                gate_w, up_w = weight.chunk(2)
                yield f"{prefix}.{e}.{gate}.weight", gate_w
                yield f"{prefix}.{e}.{up}.weight", up_w
            else:
                yield f"{prefix}.{e}.{down}.weight", weight
