"""CPU projections of bf16 weights on AMX (linear_amx.c), for the batch-invariant mode: bf16
rows times tile-shaped panels of the bf16 weight, fp32 out, each output element one chain over
the inputs whatever the other rows. The packed copy's life is AmxPanels', in
rollout/models/layers/packed_linear.py."""

from __future__ import annotations

import torch

from . import as_rows, has, library
from .ops import operator

PANEL, DEPTH = 16, 16  # a panel's output columns; input pairs a tile holds (linear_amx.c)


def supported(device: torch.device) -> bool:
    """Built for this CPU (AMX-BF16) and the tile registers granted to this process (asked for
    here, as oneDNN asks before its own AMX kernels)."""
    entry_points = ("pack_panels_amx", "linear_amx_bf16", "amx_ready")
    return device.type == "cpu" and has(*entry_points) and bool(library().amx_ready())


def layout(shape) -> tuple[int, int]:
    """(input pairs a panel, panels) of the packed [n, k] weight."""
    n, k = shape
    pairs = -(-k // (2 * DEPTH)) * DEPTH
    panels = -(-n // (2 * PANEL)) * 2
    return pairs, panels


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [n, k] (bf16, CPU) in tile-shaped panels (linear_amx.c)."""
    if weight.dtype != torch.bfloat16 or weight.device.type != "cpu" or weight.dim() != 2:
        raise ValueError(f"pack_panels_amx: weight {weight.dtype} {tuple(weight.shape)} on "
                         f"{weight.device} must be a bf16 matrix on the CPU")
    n, k = weight.shape
    pairs, panels = layout(weight.shape)
    w = weight.contiguous()
    packed = torch.empty(panels * pairs * PANEL * 2, dtype=torch.bfloat16)
    library().pack_panels_amx(w.data_ptr(), n, k, pairs, panels, packed.data_ptr(),
                              torch.get_num_threads())
    return packed


@operator("linear_amx(Tensor x, Tensor packed, int n, int k) -> Tensor",
          lambda x, packed, n, k: x.new_empty(*x.shape[:-1], n, dtype=torch.float32))
def linear(x: torch.Tensor, packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """x [..., k] (bf16, CPU) times the packed [n, k] weight's transpose: [..., n] fp32, new.
    The weight's shape is asked for whole: its padded panels hold as many values for every k
    of one tile's depth."""
    pairs, panels = layout((n, k))
    bf16 = (x.dtype == packed.dtype == torch.bfloat16
            and x.device.type == packed.device.type == "cpu")
    if not (bf16 and x.shape[-1] == k and packed.numel() == panels * pairs * PANEL * 2
            and packed.is_contiguous()):
        raise ValueError(f"linear_amx: x {x.dtype} {tuple(x.shape)} must be bf16 on the CPU "
                         f"with the in-features of the packed [{n}, {k}] weight "
                         f"({packed.numel()} packed values {packed.dtype} on {packed.device}, "
                         f"contiguous: the tiles load them in a run)")
    rows = as_rows(x)
    m = rows.shape[0]
    y = torch.empty(m, n, dtype=torch.float32)
    if m:
        # The tiles load whole 16-row, 32-input blocks: rows and inputs padded with zeros,
        # unless they come whole (a decode batch of 64 rows of 576 inputs, say)
        if m % 16 or k != 2 * pairs:
            padded = rows.new_zeros(-(-m // 16) * 16, 2 * pairs)
            padded[:m, :k] = rows
            rows = padded
        if library().linear_amx_bf16(rows.data_ptr(), rows.stride(0), m, pairs,
                                     packed.data_ptr(), n, panels, y.data_ptr(),
                                     torch.get_num_threads()):
            raise RuntimeError("linear_amx: this process was not granted the tile registers "
                               "(check supported() first)")
    return y.view(*x.shape[:-1], n)
