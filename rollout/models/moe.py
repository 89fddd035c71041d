"""The base of the sparse-MoE families (Qwen3-MoE, Mixtral): Llama's model with a sparse MoE
block (layers/moe.py) as the MLP of the layers a family says, and the routed experts of those
layers kept per KV slot (`slot_extras`).

A family file says which layers are sparse (`is_sparse`), how its router normalises
(`router_options`), its expert size's field (`expert_intermediate_field`) and its weight table.
"""

from __future__ import annotations

import torch
from torch import nn

from .base import ROUTED_EXPERTS
from .layers.moe import RouterOptions, SparseMoE
from .llama import LlamaForCausalLM

# The routed experts are kept as int16 (slot_extras): the expert ids must fit.
MAX_EXPERTS = 1 << 15


class MoECausalLM(LlamaForCausalLM):
    """Everything but the MLP of the sparse layers is Llama's."""

    @classmethod
    def is_sparse(cls, config, layer: int) -> bool:
        return True

    @classmethod
    def router_options(cls, config) -> RouterOptions:
        raise NotImplementedError

    # The config fields of an expert's intermediate size and of the number of experts (the
    # families name them apart; a refusal names them).
    expert_intermediate_field: str
    experts_field: str

    @classmethod
    def check_router(cls, options: RouterOptions) -> None:
        """Refuse at build what would fail the first step (torch.topk's k out of range) or
        silently wrap in the int16 routes (expert ids of 2**15 and up)."""
        if options.num_experts > MAX_EXPERTS:
            raise ValueError(f"{cls.experts_field}={options.num_experts}: the routed experts are "
                             f"kept as int16, so at most {MAX_EXPERTS} experts")
        if not 1 <= options.top_k <= options.num_experts:
            raise ValueError(f"num_experts_per_tok={options.top_k}: must be 1 to "
                             f"{cls.experts_field}={options.num_experts}")

    @classmethod
    def mlp_bias(cls, config) -> bool:
        return False  # the dense layers' MLP has none in either family

    def mlp(self, config, layer: int) -> nn.Module:
        if not self.is_sparse(config, layer):
            return super().mlp(config, layer)
        # Its place among the sparse layers: its row of the routed experts.
        moe_index = sum(self.is_sparse(config, i) for i in range(layer))
        field = self.expert_intermediate_field
        return SparseMoE(config.hidden_size, (field, getattr(config, field)), config.hidden_act,
                         self.router_options(config), moe_index)

    def __init__(self, config, max_model_len: int) -> None:
        moe_layers = tuple(i for i in range(config.num_hidden_layers)
                           if self.is_sparse(config, i))
        options = self.router_options(config)
        if moe_layers:  # (a Qwen3-MoE config of num_experts=0 is a dense model)
            self.check_router(options)
        super().__init__(config, max_model_len)
        self.moe_layers, self.top_k = moe_layers, options.top_k

    def slot_extras(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        if not self.moe_layers:
            return {}
        # int16: expert ids below MAX_EXPERTS (128 experts in Qwen3-30B-A3B, 8 in Mixtral).
        return {ROUTED_EXPERTS: ((len(self.moe_layers), self.top_k), torch.int16)}
