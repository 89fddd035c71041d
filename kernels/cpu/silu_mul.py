"""silu(gate) * up in C (silu_mul.c) for the gated MLP on the CPU in fp32: one pass instead of
two torch ops. Its exp is ~2 ulp from libm's, so outputs are a float32 rounding or two from
torch's."""

from __future__ import annotations

import torch

from . import as_rows, fp32_cpu, has, library
from .ops import operator


def supported(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype == torch.float32 and has("silu_mul_f32")


@operator("silu_mul(Tensor gate, Tensor up) -> Tensor",
          lambda gate, up: gate.new_empty(gate.shape))
def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate and up [..., dim] of one shape, CPU fp32 (the halves of a fused
    gate-up output: rows apart, unit stride within); a new contiguous tensor."""
    if not (gate.shape == up.shape and fp32_cpu(gate, up)):
        raise ValueError(f"silu_mul: gate {gate.dtype} {tuple(gate.shape)} and up {up.dtype} "
                         f"{tuple(up.shape)} must be fp32 on the CPU, of one shape")
    g, u = as_rows(gate), as_rows(up)
    out = torch.empty(gate.shape, dtype=gate.dtype, device="cpu")
    library().silu_mul_f32(g.data_ptr(), g.stride(0), u.data_ptr(), u.stride(0), out.data_ptr(),
                           *g.shape, torch.get_num_threads())
    return out
