"""Gemma 2: sliding-window layers interleaved with global ones, "sandwich" norms (RMSNorm before
and after both attention and MLP), every RMSNorm in the (1 + w) form, the embedding scaled by
sqrt(hidden_size), attention scores scaled by query_pre_attn_scalar ** -0.5 and soft-capped
(cap * tanh(s / cap)), and the final logits soft-capped too."""

from __future__ import annotations

import torch
from torch import nn

from .base import (SPLIT_GATE_UP, SPLIT_QKV, WINDOW_BY_LAYER_TYPE, CausalLM, WeightTable,
                   register, sliding_windows)
from .layers import (
    Attention,
    AttentionOptions,
    Decoder,
    GatedMLP,
    RMSNorm,
    RotaryEmbedding,
    VocabParallelEmbedding,
    lm_head,
)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config, layer: int, options: AttentionOptions) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        act = getattr(config, "hidden_activation", None) or config.hidden_act
        self.input_layernorm = RMSNorm(hidden, eps, offset=True)
        self.self_attn = Attention(config, layer, options)
        self.post_attention_layernorm = RMSNorm(hidden, eps, offset=True)
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps, offset=True)
        self.mlp = GatedMLP(hidden, config.intermediate_size, act)
        self.post_feedforward_layernorm = RMSNorm(hidden, eps, offset=True)

    def forward(self, x: torch.Tensor, rope: RotaryEmbedding, ctx) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), rope, ctx))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


@register("gemma2")
class Gemma2ForCausalLM(CausalLM):
    WEIGHTS = WeightTable(fused=(SPLIT_QKV, SPLIT_GATE_UP))

    @classmethod
    def attention_options(cls, config) -> AttentionOptions:
        bias = bool(getattr(config, "attention_bias", False))
        return AttentionOptions(qkv_bias=bias, o_bias=bias,
                                scale=config.query_pre_attn_scalar ** -0.5,
                                softcap=config.attn_logit_softcapping)

    @classmethod
    def window_rule(cls, config) -> str:
        return WINDOW_BY_LAYER_TYPE

    def layer_ropes(self, config, head_dim: int, max_model_len: int) -> list[RotaryEmbedding]:
        """The rotary table of each layer: one for all of them."""
        self.rope = RotaryEmbedding(config, head_dim, max_model_len)
        return [self.rope] * config.num_hidden_layers

    def __init__(self, config, max_model_len: int) -> None:
        super().__init__(config)
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError("use_bidirectional_attention: only causal Gemma models generate")
        options = self.attention_options(config)
        self.model = Decoder(config, lambda i: GemmaDecoderLayer(config, i, options),
                             norm_offset=True)
        self.lm_head = lm_head(config)
        head_dim = self.model.layers[0].self_attn.head_dim
        self._ropes = self.layer_ropes(config, head_dim, max_model_len)  # a list: not registered
        self.kv_layout = self.model.kv_layout(
            sliding_windows(config, max_model_len, self.window_rule(config)))
        self.final_softcap = getattr(config, "final_logit_softcapping", None)

    @property
    def head(self) -> VocabParallelEmbedding:
        return self.model.embed_tokens if self.lm_head is None else self.lm_head

    def forward(self, input_ids: torch.Tensor, ctx) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        # The reference rounds the normaliser to the weights' dtype (sqrt(3072) is 55.5 in bf16).
        x = x * float(torch.tensor(self.config.hidden_size ** 0.5, dtype=x.dtype))
        for layer, rope in zip(self.model.layers, self._ropes):
            x = layer(x, rope, ctx)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head.logits(hidden, self.final_softcap)
