"""Mixtral: Mistral's attention (optional sliding window on every layer) and a sparse MoE block
on every layer, no shared expert. Router: softmax over all experts, top-k, renormalised (the
same as a softmax over the top-k logits); the weights stay fp32 when they scale the experts.

Checkpoints name the block `block_sparse_moe` and each expert's projections w1 (gate), w3 (up),
w2 (down): `block_sparse_moe.experts.<e>.w1.weight`; transformers 5 models call the block `mlp`
and hold the experts stacked (`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`) as we do."""

from __future__ import annotations

from .base import SPLIT_QKV, Stacked, WeightTable, register
from .layers import AttentionOptions
from .layers.moe import RouterOptions
from .moe import MoECausalLM

EXPERTS = (Stacked("experts", "w1", "gate_up_proj", 0),
           Stacked("experts", "w3", "gate_up_proj", 1),
           Stacked("experts", "w2", "down_proj"))


@register("mixtral")
class MixtralForCausalLM(MoECausalLM):
    WEIGHTS = WeightTable(fused=(SPLIT_QKV,), stacked=EXPERTS,
                          renamed=((".block_sparse_moe.", ".mlp."),))

    @classmethod
    def attention_options(cls, config) -> AttentionOptions:
        return AttentionOptions()

    @classmethod
    def router_options(cls, config) -> RouterOptions:
        return RouterOptions(num_experts=config.num_local_experts,
                             top_k=config.num_experts_per_tok,
                             normalize=True, weights_in_model_dtype=False)

    expert_intermediate_field = "intermediate_size"
    experts_field = "num_local_experts"
