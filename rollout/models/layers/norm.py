"""RMSNorm in the two forms the reference models use."""

from __future__ import annotations

import torch
from torch import nn

from rollout_kernels.cpu import norm_rope

from ...ops.op import Dispatched, always


class RMSNorm(Dispatched, nn.Module):
    """Normalised in fp32. `offset=False` (Llama, Qwen, Phi-3): cast back to the input dtype,
    then times the weight. `offset=True` (Gemma): times (1 + weight) still in fp32, then cast;
    Gemma checkpoints store the weight minus one."""

    implementations = {"torch": always, "cpu": norm_rope.supported}

    def __init__(self, dim: int, eps: float, offset: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim))
        self.eps, self.offset = eps, offset

    def use_backend(self, backend, dtype: torch.dtype) -> None:
        # The Triton norm only in the batch-invariant mode: torch's row reductions on CUDA
        # split a row across blocks when the rows are few, so a row rounds with the batch.
        if backend.triton_rows:
            from rollout_kernels.triton.row_invariant import rms_norm

            self.rows_norm = rms_norm
            self.implementation = "triton"
        else:
            super().use_backend(backend, dtype)

    def _scale(self) -> torch.Tensor:
        return 1.0 + self.weight if self.offset else self.weight

    def add_forward(self, x: torch.Tensor, delta: torch.Tensor | None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, the norm of it): a residual stream's step and the norm that reads it,
        one pass on the C path (one dispatch instead of two, and parallel where torch's add of
        a decode step's few rows is not). No delta: (x, the norm of x)."""
        if delta is None:
            return x, self(x)
        if self.implementation == "cpu" and delta.dtype == x.dtype == torch.float32:
            return norm_rope.add_rms_norm(x, delta, self._scale(), self.eps)
        x = x + delta
        return x, self(x)

    def forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
        """Sums the squares in another order than torch: a float32 rounding apart. Activations
        that are not fp32 (F.linear under a trainer's bf16 autocast, with pack_cpu_weights
        off) take the torch path."""
        if x.dtype != torch.float32:
            return self.forward_torch(x)
        return norm_rope.rms_norm(x, self._scale(), self.eps)

    def forward_triton(self, x: torch.Tensor) -> torch.Tensor:
        return self.rows_norm(x, self.weight, self.eps, self.offset)

    def forward_torch(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (h * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight * h.to(x.dtype)
