"""LoRA on the stacked MoE experts, served unmerged: expert e's gate-up (or down) projection
of its tokens is x W_e^T + s * (x A_e^T) B_e^T.

PEFT adapts a stacked expert parameter as a whole (`target_parameters`, its ParamWrapper): one
rank-r adapter per expert, the same rank and scale for all. Here each adapted stack holds
`a` [E, r, in] and `b` [E, out, r], float32 as PEFT keeps them (rollout/lora/source.py reads
PEFT's interleaved layout into these). The delta is computed per expert, over the tokens
routed to it: by `moe_torch` (layers/moe.py) expert by expert, and by the Triton experts
(kernels/triton/fused_moe.py) as grouped shrink and expand matmuls whose results the gate-up
and down kernels add before their rounding.

Tensor parallel as the base: a rank's gate-up rows are its rows of B (A whole); its down
columns are its columns of A (B whole), so the down delta is a partial sum that the block's
all-reduce completes with the base's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .lora import LORA_DTYPE


@dataclass(frozen=True)
class ExpertBlock:
    """An adapter on one stacked parameter of the experts ("gate_up_proj" or "down_proj")."""

    attr: str
    rank: int
    scale: float


class ExpertLora(nn.Module):
    def __init__(self, num_experts: int, out_features: int, in_features: int,
                 block: ExpertBlock, device: torch.device) -> None:
        super().__init__()
        self.block = block
        self.a = nn.Parameter(torch.zeros(num_experts, block.rank, in_features,
                                          dtype=LORA_DTYPE, device=device), requires_grad=False)
        self.b = nn.Parameter(torch.zeros(num_experts, out_features, block.rank,
                                          dtype=LORA_DTYPE, device=device), requires_grad=False)

    def factors(self) -> tuple[torch.Tensor, torch.Tensor, float]:
        """(A [E, r, in], B [E, out, r], scale): what the experts' implementations take."""
        return self.a, self.b, self.block.scale


def add_expert_delta(y: torch.Tensor, x: torch.Tensor,
                     factors: tuple[torch.Tensor, torch.Tensor, float] | None,
                     expert: int) -> torch.Tensor:
    """y (expert `expert`'s base projection of its tokens x) plus its adapter's delta, added in
    float32 with one rounding to y's dtype; y itself without an adapter."""
    if factors is None:
        return y
    a, b, scale = factors
    shrunk = torch.mm(x.to(LORA_DTYPE), a[expert].t())
    return torch.addmm(y.to(LORA_DTYPE), shrunk, b[expert].t(), alpha=scale).to(y.dtype)
