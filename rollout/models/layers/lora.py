"""A LoRA adapter served unmerged on one projection: y = x W^T + b + s * (x A^T) B^T.

The base weight W stays as loaded; `update_weights` copies only A and B (rollout/lora/). A fused
projection (QKV, gate-up) holds one block per checkpoint module the adapter targets: their A
matrices stacked along the rank axis, so one shrink covers them all, and B block-diagonal (each
block's rows are its shard's, its columns its rank's, zeros elsewhere), so one expand does.
Zeros add exactly, so the blocks do not mix.

A and B are float32 whatever the model's dtype, and so is the delta, added to the base output
with one rounding: what PEFT computes by default (it keeps adapters in float32 and casts x to
them), so a bf16 engine stays as close to the trainer's forward as its bf16 base allows; a
merged bf16 weight rounds W + s*BA to bf16 instead, which costs far more than the delta's size.

Tensor parallel: a column-parallel projection (MergedLinear) holds its rows of B and all of A;
a row-parallel one (o_proj, down_proj) its input columns of A and all of B, so its delta is a
partial sum like its base output and the same all-reduce completes both.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from rollout_kernels.cpu import linear as native_linear

from ...ops.op import always, on_cuda
from .packed_linear import SmallPanels

LORA_DTYPE = torch.float32


@dataclass(frozen=True)
class LoraBlock:
    """One targeted checkpoint module inside a projection: rows [row, row + rows) of the
    projection's (local) output, `rank` columns of B and rows of A, scaled by `scale`."""

    row: int
    rows: int
    rank: int
    scale: float


def implementations(pack_weights: bool, batch_invariant: bool) -> dict:
    """The delta's implementations (rollout/ops/op.py), chosen by the engine's backend when an
    adapter is attached: "cpu" where the base multiplies by packed weights too and linear.c
    runs on its intrinsics (in the batch-invariant mode, on any build: its rows are apart),
    "triton" (kernels/triton/lora.py) on CUDA."""
    usable = native_linear.invariant_supported if batch_invariant else native_linear.add_supported
    return {"torch": always, "triton": on_cuda,
            "cpu": lambda device, dtype: pack_weights and usable(device)}


class LoraWeights(nn.Module):
    """`implementation` "torch": F.linear and one addmm over the block-diagonal B. "cpu":
    packed panels through rollout_kernels.cpu's linear.c, A's for the shrink, and each block's
    own part of B for its expand, added in place into that block's rows of the base output (no
    zeros multiplied, no delta tensor); at decode batch sizes a matmul whose inner dimension is
    a rank costs F.linear two to three times the C kernel's time (docs/benchmarks.md). The
    panels are derived like the projections' packed weights: packed after update_weights,
    dropped at sleep, checked against the weights' versions at every use. "triton": the shrink
    and the per-block expand of kernels/triton/lora.py, the blocks as device tensors."""

    def __init__(self, in_features: int, out_features: int, blocks: tuple[LoraBlock, ...],
                 device: torch.device, implementation: str = "torch",
                 all_rows: bool = False) -> None:
        """`all_rows` (the batch-invariant mode: a row must not depend on how many there are):
        "cpu" runs the panels for any number of rows, not only up to native_linear.MAX_ROWS;
        "triton" under the interpreter sums its products explicitly."""
        super().__init__()
        self.blocks, self.implementation, self.all_rows = blocks, implementation, all_rows
        # Each block's first column of B (row of A), and the largest block's rows and rank (the
        # Triton grid's): fixed with the blocks, so worked out here, not per forward.
        self.columns = tuple(sum(b.rank for b in blocks[:i]) for i in range(len(blocks)))
        self.max_rows, self.max_rank = max(b.rows for b in blocks), max(b.rank for b in blocks)
        rank = sum(b.rank for b in blocks)
        self.a = nn.Parameter(torch.zeros(rank, in_features, dtype=LORA_DTYPE, device=device),
                              requires_grad=False)
        self.b = nn.Parameter(torch.zeros(out_features, rank, dtype=LORA_DTYPE, device=device),
                              requires_grad=False)
        scales = {b.scale for b in blocks}
        # One scale (the usual case) rides on the expand's alpha; several (PEFT's rank_pattern
        # or alpha_pattern) scale the shrink's columns, block by block.
        self.scale = scales.pop() if len(scales) == 1 else 1.0
        columns = None
        if len(scales) > 1:
            columns = torch.cat([torch.full((b.rank,), b.scale, dtype=LORA_DTYPE)
                                 for b in blocks]).to(device)
        self.register_buffer("column_scales", columns, persistent=False)
        # [A's panels, then one per block of B]
        native = implementation == "cpu"
        self.panels = [SmallPanels(all_rows) for _ in range(len(blocks) + 1)] if native else None
        triton = implementation == "triton"
        # The Triton kernels' row_dot precision: the batch-invariant mode (all_rows) sums
        # explicitly under the interpreter (kernels/triton/row_invariant.py).
        self.precision = "ieee"
        if triton and all_rows:
            from rollout_kernels.triton.row_invariant import dot_precision

            self.precision = dot_precision(LORA_DTYPE, device.type == "cuda")
        self.register_buffer("block_rows", torch.tensor(
            [[b.row, b.rows, col] for b, col in zip(blocks, self.columns)],
            dtype=torch.int32, device=device) if triton else None, persistent=False)
        self.register_buffer("block_ranks", torch.tensor(
            [b.rank for b in blocks], dtype=torch.int32, device=device) if triton else None,
            persistent=False)
        self.register_buffer("block_scales", torch.tensor(
            [b.scale for b in blocks], dtype=LORA_DTYPE, device=device) if triton else None,
            persistent=False)

    def block_views(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(A rows, B block) of each block, views into `a` and `b`, in block order."""
        return [(self.a.narrow(0, col, blk.rank),
                 self.b.narrow(0, blk.row, blk.rows).narrow(1, col, blk.rank))
                for blk, col in zip(self.blocks, self.columns)]

    def add_to(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y + the adapter's delta for input x (y: the base projection of x)."""
        x = x.to(LORA_DTYPE)
        out = y.reshape(-1, y.shape[-1])
        rows_fit = self.all_rows or out.shape[0] <= native_linear.MAX_ROWS
        if self.panels is not None and rows_fit:
            return self._add_native(x, out).view(y.shape)
        if self.implementation == "triton":
            return self._add_triton(x.reshape(-1, x.shape[-1]), out).view(y.shape)
        shrunk = F.linear(x, self.a)
        if self.column_scales is not None:
            shrunk = shrunk * self.column_scales
        flat = shrunk.reshape(-1, shrunk.shape[-1])
        if out.dtype == LORA_DTYPE:
            return out.addmm_(flat, self.b.t(), alpha=self.scale).view(y.shape)
        return torch.addmm(out.to(LORA_DTYPE), flat, self.b.t(),
                           alpha=self.scale).to(y.dtype).view(y.shape)

    def _add_native(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        shrunk = self.panels[0].linear(x, self.a, None).reshape(out.shape[0], -1)
        acc = out if out.dtype == LORA_DTYPE else out.to(LORA_DTYPE)
        for blk, col, panel, (_, b) in zip(self.blocks, self.columns, self.panels[1:],
                                           self.block_views()):
            native_linear.linear_add(shrunk[:, col:col + blk.rank], panel.refresh(b),
                                     acc[:, blk.row:blk.row + blk.rows], blk.scale)
        return acc if acc is out else acc.to(out.dtype)

    def _add_triton(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        from rollout_kernels.triton.lora import lora_expand_add, lora_shrink

        shrunk = lora_shrink(x if x.stride(-1) == 1 else x.contiguous(), self.a, self.precision)
        lora_expand_add(shrunk, self.b, out, self.block_rows, self.block_ranks,
                        self.block_scales, self.max_rows, self.max_rank, self.precision)
        return out

    # Derived panels, as CausalLM handles a projection's packed weights (base.py).
    def pack(self) -> None:
        if self.panels is not None:
            self.panels[0].refresh(self.a)
            for panel, (_, b) in zip(self.panels[1:], self.block_views()):
                panel.refresh(b)

    def drop_derived(self) -> None:
        for panel in self.panels or ():
            panel.drop()

    def derived_bytes(self) -> int:
        return sum(p.nbytes for p in self.panels or ())
