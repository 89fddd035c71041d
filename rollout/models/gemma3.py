"""Gemma 3 (text, `Gemma3ForCausalLM`): Gemma 2 plus an RMSNorm (1 + w) over each head's q and
k, RoPE parameters per layer type (a local base, 10K, on sliding layers; a global one, 1M and
possibly scaled, on full ones), and no attention soft-capping (the reference never applies
attn_logit_softcapping). The multimodal `gemma3` model_type is not served."""

from __future__ import annotations

from torch import nn

from .base import register
from .gemma2 import Gemma2ForCausalLM
from .layers import AttentionOptions, RotaryEmbedding


@register("gemma3_text")
class Gemma3ForCausalLM(Gemma2ForCausalLM):
    @classmethod
    def attention_options(cls, config) -> AttentionOptions:
        bias = bool(getattr(config, "attention_bias", False))
        return AttentionOptions(qkv_bias=bias, o_bias=bias, qk_norm=True, norm_offset=True,
                                scale=config.query_pre_attn_scalar ** -0.5)

    def layer_ropes(self, config, head_dim: int, max_model_len: int) -> list[RotaryEmbedding]:
        types = config.layer_types
        self.ropes = nn.ModuleDict({t: RotaryEmbedding(config, head_dim, max_model_len, t)
                                    for t in sorted(set(types))})
        return [self.ropes[t] for t in types]
