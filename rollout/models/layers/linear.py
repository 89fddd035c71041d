"""Fused projections: one matmul for what checkpoints store as several linears.

A `MergedLinear` stacks its shards along the output dimension (Q, K, V; gate, up) and knows
their sizes; a family's weight table (models/base.py) says which checkpoint tensors fill which
shard. Sizes live here and names there, so the layout is written down once.
"""

from __future__ import annotations

import torch
from torch import nn


class MergedLinear(nn.Linear):
    def __init__(self, in_features: int, shard_sizes: tuple[int, ...], bias: bool) -> None:
        super().__init__(in_features, sum(shard_sizes), bias=bias)
        self.shard_sizes = tuple(shard_sizes)

    def forward_split(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self(x).split(self.shard_sizes, dim=-1)
