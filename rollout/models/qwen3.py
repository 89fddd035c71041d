"""Qwen3: Llama's layers with an RMSNorm over each head's q and k before RoPE."""

from __future__ import annotations

from .base import WINDOW_BY_LAYER_TYPE, register
from .layers import AttentionOptions
from .llama import LlamaForCausalLM


@register("qwen3")
class Qwen3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def attention_options(cls, config) -> AttentionOptions:
        bias = bool(getattr(config, "attention_bias", False))
        return AttentionOptions(qkv_bias=bias, o_bias=bias, qk_norm=True)

    @classmethod
    def mlp_bias(cls, config) -> bool:
        return False

    @classmethod
    def window_rule(cls, config) -> str:
        return WINDOW_BY_LAYER_TYPE  # use_sliding_window and max_window_layers set layer_types
