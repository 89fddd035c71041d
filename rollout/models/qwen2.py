"""Qwen2 (and Qwen2.5): Llama's layers with a bias on the Q, K and V projections."""

from __future__ import annotations

from .base import WINDOW_BY_LAYER_TYPE, register
from .layers import AttentionOptions
from .llama import LlamaForCausalLM


@register("qwen2")
class Qwen2ForCausalLM(LlamaForCausalLM):
    @classmethod
    def attention_options(cls, config) -> AttentionOptions:
        return AttentionOptions(qkv_bias=True)

    @classmethod
    def mlp_bias(cls, config) -> bool:
        return False

    @classmethod
    def window_rule(cls, config) -> str:
        return WINDOW_BY_LAYER_TYPE  # use_sliding_window and max_window_layers set layer_types
