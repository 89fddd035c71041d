"""Phi-3 (and Phi-4-mini, same model_type): Llama's layers, no biases. The checkpoint stores
`qkv_proj` and `gate_up_proj` fused already, in our shard order (q, k, v; gate, up), so the
weight table maps them by name, whole. LongRoPE (`rope_type` "longrope", formerly "su") and
partial rotary come through layers/rotary.py; `sliding_window` applies to every layer."""

from __future__ import annotations

from .base import WeightTable, register
from .llama import MistralForCausalLM


@register("phi3")
class Phi3ForCausalLM(MistralForCausalLM):  # Mistral's: Llama's layers without biases
    WEIGHTS = WeightTable()  # no split projections to fuse: every name maps to itself
    PARTIAL_ROTARY = True
