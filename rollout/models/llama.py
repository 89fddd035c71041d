"""Llama and Mistral: pre-norm decoder layers (RMSNorm, attention, RMSNorm, gated MLP), the
base that Qwen2, Qwen3 and Phi-3 change a few options of.

Mistral's sliding window (all layers) and Qwen's per-layer windows come from the config
through `sliding_windows`; the attention backends apply them.
"""

from __future__ import annotations

import torch
from torch import nn

from .base import SPLIT_GATE_UP, SPLIT_QKV, CausalLM, WeightTable, register, sliding_windows
from .layers import Attention, AttentionOptions, Decoder, GatedMLP, RMSNorm, RotaryEmbedding


class DecoderLayer(nn.Module):
    def __init__(self, config, layer: int, options: AttentionOptions, mlp_bias: bool) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer, options)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act,
                            mlp_bias)

    def forward(self, x: torch.Tensor, rope: RotaryEmbedding, ctx) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, ctx)
        return x + self.mlp(self.post_attention_layernorm(x))


@register("llama", "mistral")
class LlamaForCausalLM(CausalLM):
    WEIGHTS = WeightTable(fused=(SPLIT_QKV, SPLIT_GATE_UP))

    @classmethod
    def attention_options(cls, config) -> AttentionOptions:
        bias = bool(getattr(config, "attention_bias", False))
        return AttentionOptions(qkv_bias=bias, o_bias=bias)

    @classmethod
    def mlp_bias(cls, config) -> bool:
        return bool(getattr(config, "mlp_bias", False))

    def __init__(self, config, max_model_len: int) -> None:
        super().__init__(config)
        options, mlp_bias = self.attention_options(config), self.mlp_bias(config)
        self.model = Decoder(config, lambda i: DecoderLayer(config, i, options, mlp_bias))
        self.lm_head = None if self.tie_word_embeddings else nn.Linear(
            config.hidden_size, config.vocab_size, bias=False)
        head_dim = self.model.layers[0].self_attn.head_dim
        self.rope = RotaryEmbedding(config, head_dim, max_model_len)
        self.kv_layout = self.model.kv_layout(sliding_windows(config, max_model_len))

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def forward(self, input_ids: torch.Tensor, ctx) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            x = layer(x, self.rope, ctx)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return (hidden @ self.lm_head_weight.t()).float()
