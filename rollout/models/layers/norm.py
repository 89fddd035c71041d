"""RMSNorm in the two forms the reference models use."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """Normalised in fp32. `offset=False` (Llama, Qwen, Phi-3): cast back to the input dtype,
    then times the weight. `offset=True` (Gemma): times (1 + weight) still in fp32, then cast;
    Gemma checkpoints store the weight minus one."""

    def __init__(self, dim: int, eps: float, offset: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim))
        self.eps, self.offset = eps, offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (h * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight * h.to(x.dtype)
