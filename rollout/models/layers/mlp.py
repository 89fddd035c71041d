"""The gated MLP of every dense family: down(act(gate(x)) * up(x)), gate and up fused. Under
tensor parallelism a rank holds 1/k of the intermediate dimension: gate-up column-parallel,
down row-parallel (one all-reduce)."""

from __future__ import annotations

import torch
from torch import nn
from transformers.activations import ACT2FN

from ...native import silu_mul
from ...parallel import Slice, current, even_split
from .linear import MergedLinear, RowParallelLinear, row_sources


class GatedMLP(nn.Module):
    native = False  # use_backends: silu(gate) * up in rollout/native's C (CPU, fp32)

    def __init__(self, hidden_size: int, intermediate_size: int, act: str,
                 bias: bool = False) -> None:
        super().__init__()
        tp = current()
        start, local = even_split(intermediate_size, tp, "intermediate_size")
        self.intermediate = local
        rows = row_sources(start, local, intermediate_size, tp)
        self.gate_up_proj = MergedLinear(hidden_size, (local, local), bias,
                                         sources=None if rows is None else (rows, rows))
        cols = None if rows is None else Slice(1, start, local, intermediate_size)
        self.down_proj = RowParallelLinear(local, hidden_size, bias, tp, cols)
        self.act, self.act_name = ACT2FN[act], act

    def use_backends(self, backends) -> None:
        self.native = self.act_name == "silu" and backends.native_layer_ops(
            self.down_proj.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj.forward_split(x)
        if self.native and gate.dtype == torch.float32 and gate.device.type == "cpu":
            return self.down_proj(silu_mul.silu_mul(gate, up))
        return self.down_proj(self.act(gate) * up)
