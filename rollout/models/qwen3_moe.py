"""Qwen3-MoE (e.g. Qwen3-30B-A3B): Qwen3's attention (q/k RMSNorm) and sparse MoE blocks without
a shared expert. Router: softmax over all experts, top-k, renormalised to sum to one only when
`norm_topk_prob`; the weights are rounded to the model dtype before they scale the experts.
A layer is sparse unless it is in `mlp_only_layers`, and only every `decoder_sparse_step`-th
(layers i with (i + 1) % step == 0); the others have a dense gated MLP of `intermediate_size`.

Checkpoints name each expert (`mlp.experts.<e>.{gate,up,down}_proj.weight`); transformers 5
models hold them stacked (`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`) as we do."""

from __future__ import annotations

from .base import SPLIT_GATE_UP, SPLIT_QKV, Stacked, WeightTable, register
from .layers import AttentionOptions
from .layers.moe import RouterOptions
from .moe import MoECausalLM

EXPERTS = (Stacked("experts", "gate_proj", "gate_up_proj", 0),
           Stacked("experts", "up_proj", "gate_up_proj", 1),
           Stacked("experts", "down_proj", "down_proj"))


@register("qwen3_moe")
class Qwen3MoeForCausalLM(MoECausalLM):
    # Stacked entries are matched before the fused ones: `experts.<e>.gate_proj` is an expert's.
    WEIGHTS = WeightTable(fused=(SPLIT_QKV, SPLIT_GATE_UP), stacked=EXPERTS)

    @classmethod
    def attention_options(cls, config) -> AttentionOptions:
        bias = bool(getattr(config, "attention_bias", False))
        return AttentionOptions(qkv_bias=bias, o_bias=bias, qk_norm=True)

    @classmethod
    def is_sparse(cls, config, layer: int) -> bool:
        return (layer not in (getattr(config, "mlp_only_layers", None) or [])
                and config.num_experts > 0
                and (layer + 1) % getattr(config, "decoder_sparse_step", 1) == 0)

    @classmethod
    def router_options(cls, config) -> RouterOptions:
        return RouterOptions(num_experts=config.num_experts,
                             top_k=config.num_experts_per_tok,
                             normalize=bool(config.norm_topk_prob), weights_in_model_dtype=True)

    expert_intermediate_field = "moe_intermediate_size"
    experts_field = "num_experts"
