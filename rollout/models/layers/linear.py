"""Projections: fused ones (one matmul for what checkpoints store as several linears) and the two
halves of a tensor-parallel pair.

A `MergedLinear` stacks its shards along the output dimension (Q, K, V; gate, up) and knows
their sizes; a family's weight table (models/base.py) says which checkpoint tensors fill which
shard. Sizes live here and names there, so the layout is written down once.

Tensor parallel (rollout/parallel/): a `MergedLinear` is column-parallel, each rank holding its
rows of every shard (`sources`: where each shard's rows come from in the checkpoint's tensor),
so its output needs no communication; the `RowParallelLinear` after it holds the matching
input columns and sums the ranks' partial outputs with one all-reduce.

Both multiply through `Projection.project` (packed_linear.py): by a oneDNN-packed copy of the
weight on CPU, by the weight itself elsewhere.
"""

from __future__ import annotations

import torch
from torch import nn

from ...parallel import Concat, Slice, TensorParallel, all_reduce
from .packed_linear import Projection


class MergedLinear(Projection, nn.Linear):
    def __init__(self, in_features: int, shard_sizes: tuple[int, ...], bias: bool,
                 sources: tuple[Slice, ...] | None = None) -> None:
        super().__init__(in_features, sum(shard_sizes), bias=bias)
        self.shard_sizes = tuple(shard_sizes)
        self.sources = sources  # None: every shard is its checkpoint tensor whole

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.project(x, self.bias)

    def forward_split(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self(x).split(self.shard_sizes, dim=-1)

    def tp_slice(self, attr: str, shard: int | None) -> Slice | Concat | None:
        """The part of the checkpoint tensor for `shard` (None: the fused tensor whole) this
        rank keeps; weight and bias alike, both along dim 0."""
        if self.sources is None:
            return None
        return Concat(self.sources) if shard is None else self.sources[shard]


class RowParallelLinear(Projection, nn.Linear):
    """Holds the input columns `source` of the checkpoint's weight; the bias is whole and added
    once, after the all-reduce."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallel,
                 source: Slice | None) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.tp, self.source = tp, source

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self.project(x, self.bias)
        out = all_reduce(self.project(x, None), self.tp)
        return out if self.bias is None else out + self.bias

    def tp_slice(self, attr: str, shard: int | None) -> Slice | None:
        return self.source if attr == "weight" else None


def row_sources(start: int, length: int, full: int, tp: TensorParallel) -> Slice | None:
    """Rows [start, start + length) of a dim-0 size `full`; None on a single rank (whole)."""
    return None if tp.size == 1 else Slice(0, start, length, full)
