"""Llama and Mistral: pre-norm decoder layers (RMSNorm, attention, RMSNorm, gated MLP), the
base that Mistral, Qwen2, Qwen3 and Phi-3 change a few options of.

Mistral's sliding window (all layers) and Qwen's per-layer windows come from the config
through `sliding_windows` and each family's `window_rule` (Llama's reference ignores the
attribute); the attention backends apply them.
"""

from __future__ import annotations

import torch
from torch import nn

from .base import (SPLIT_GATE_UP, SPLIT_QKV, WINDOW_EVERY_LAYER, WINDOW_NONE, CausalLM,
                   WeightTable, register, sliding_windows)
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


class DecoderLayer(nn.Module):
    """`mlp`: the layer's MLP, from the family's `mlp(config, layer)`. One with `takes_ctx`
    (the MoE block, layers/moe.py) is also given ctx, where it records its routing."""

    def __init__(self, config, layer: int, options: AttentionOptions, mlp: nn.Module) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer, options)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = mlp
        self.mlp_takes_ctx = getattr(mlp, "takes_ctx", False)

    def forward(self, x: torch.Tensor, pending: torch.Tensor | None, rope: RotaryEmbedding,
                ctx) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the residual stream; pending: what the layer before adds to it (its MLP's output),
        added here by the norm that reads the sum (RMSNorm.add_forward). Returns the stream and
        this layer's MLP output, for the next layer or the final norm to add."""
        x, h = self.input_layernorm.add_forward(x, pending)
        x, h = self.post_attention_layernorm.add_forward(x, self.self_attn(h, rope, ctx))
        return x, (self.mlp(h, ctx) if self.mlp_takes_ctx else self.mlp(h))


@register("llama")
class LlamaForCausalLM(CausalLM):
    WEIGHTS = WeightTable(fused=(SPLIT_QKV, SPLIT_GATE_UP))

    @classmethod
    def attention_options(cls, config) -> AttentionOptions:
        bias = bool(getattr(config, "attention_bias", False))
        return AttentionOptions(qkv_bias=bias, o_bias=bias)

    @classmethod
    def mlp_bias(cls, config) -> bool:
        return bool(getattr(config, "mlp_bias", False))

    @classmethod
    def window_rule(cls, config) -> str:
        # This class serves Llama, which never windows, and the families whose references
        # window every layer: Mistral and those built on this class (Mixtral, Phi-3,
        # Qwen3-MoE); Qwen2/3 override it.
        return WINDOW_NONE if config.model_type == "llama" else WINDOW_EVERY_LAYER

    def mlp(self, config, layer: int) -> nn.Module:
        """Layer `layer`'s MLP: the gated MLP; the MoE families (moe.py) put a sparse block on
        the layers they say."""
        return GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act,
                        self.mlp_bias(config))

    def __init__(self, config, max_model_len: int) -> None:
        super().__init__(config)
        options = self.attention_options(config)
        self.model = Decoder(config,
                             lambda i: DecoderLayer(config, i, options, self.mlp(config, i)))
        self.lm_head = lm_head(config)
        head_dim = self.model.layers[0].self_attn.head_dim
        self.rope = RotaryEmbedding(config, head_dim, max_model_len,
                                    partial_rotary=self.PARTIAL_ROTARY)
        self.kv_layout = self.model.kv_layout(
            sliding_windows(config, max_model_len, self.window_rule(config)))

    @property
    def head(self) -> VocabParallelEmbedding:
        return self.model.embed_tokens if self.lm_head is None else self.lm_head

    def forward(self, input_ids: torch.Tensor, ctx) -> torch.Tensor:
        x, pending = self.model.embed_tokens(input_ids), None
        for layer in self.model.layers:
            x, pending = layer(x, pending, self.rope, ctx)
        return self.model.norm.add_forward(x, pending)[1]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head.logits(hidden)


@register("mistral")
class MistralForCausalLM(LlamaForCausalLM):
    """Llama's layers; transformers' Mistral builds no bias whatever `attention_bias` and
    `mlp_bias` say, so neither is read."""

    @classmethod
    def attention_options(cls, config) -> AttentionOptions:
        return AttentionOptions()

    @classmethod
    def mlp_bias(cls, config) -> bool:
        return False
