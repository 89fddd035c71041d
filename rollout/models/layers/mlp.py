"""The gated MLP of every dense family: down(act(gate(x)) * up(x)), gate and up fused. Under
tensor parallelism a rank holds 1/k of the intermediate dimension: gate-up column-parallel,
down row-parallel (one all-reduce)."""

from __future__ import annotations

import torch
from torch import nn
from transformers.activations import ACT2FN

from rollout_kernels.cpu import silu_mul

from ...ops.op import Dispatched, always
from ...parallel import Slice, current, even_split
from .linear import MergedLinear, RowParallelLinear, row_sources


class GatedMLP(Dispatched, nn.Module):
    """cpu: silu(gate) * up in one C pass (SiLU models only; its exp is ~2 ulp from libm's)."""

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
        self.act = ACT2FN[act]
        self.implementations = {"torch": always}
        if act == "silu":
            self.implementations["cpu"] = silu_mul.supported

    def forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj.forward_split(x)
        # (activations off fp32, under a trainer's autocast: torch's, as RMSNorm.forward_cpu)
        h = silu_mul.silu_mul(gate, up) if gate.dtype == torch.float32 else self.act(gate) * up
        return self.down_proj(h)

    def forward_torch(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj.forward_split(x)
        return self.down_proj(self.act(gate) * up)
