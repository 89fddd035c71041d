"""The gated MLP of every dense family: down(act(gate(x)) * up(x)), gate and up fused."""

from __future__ import annotations

import torch
from torch import nn
from transformers.activations import ACT2FN

from .linear import MergedLinear


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, act: str,
                 bias: bool = False) -> None:
        super().__init__()
        self.intermediate = intermediate_size
        self.gate_up_proj = MergedLinear(hidden_size, (intermediate_size, intermediate_size), bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.act = ACT2FN[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj.forward_split(x)
        return self.down_proj(self.act(gate) * up)
