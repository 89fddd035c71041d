"""Packed copies of an MoE block's router and of every expert's two matrices, where the
projections are packed (packed_linear.packing_for): on the CPU backend the experts multiply by
the panels as the dense projections do (on F.linear a small Qwen3-MoE's fp32 rollout ran at
0.67-0.83 of their speed, docs/benchmarks.md), and in the batch-invariant
mode (EngineConfig.batch_invariant) by the invariant packing, since F.linear's rows round with
how many tokens the expert drew, i.e. with the batch. The copies have the projections' life:
made when the engine is built, again when a weight changes (each copy checks its weight's
storage and version at use), dropped at sleep, counted in memory_held. They double the experts'
memory, as packing doubles a dense model's weights."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.nn import functional as F

from .packed_linear import PackedCopy


class PackedExperts:
    def __init__(self, num_experts: int, make: Callable[[], PackedCopy | None]) -> None:
        self.router = make()
        self.gate_up = [make() for _ in range(num_experts)]
        self.down = [make() for _ in range(num_experts)]

    def _copies(self, gate: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor):
        """(copy, weight) of the router and of every expert's gate-up and down."""
        yield self.router, gate
        yield from zip(self.gate_up, gate_up)
        yield from zip(self.down, down)

    @staticmethod
    def linear(copy: PackedCopy | None, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.linear(x, weight) if copy is None else copy.linear(x, weight, None)

    def pack(self, gate, gate_up, down) -> None:
        for copy, weight in self._copies(gate, gate_up, down):
            if copy is not None:
                copy.refresh(weight)

    def drop(self) -> None:
        for copy in (self.router, *self.gate_up, *self.down):
            if copy is not None:
                copy.drop()

    def nbytes(self) -> int:
        return sum(copy.nbytes for copy in (self.router, *self.gate_up, *self.down)
                   if copy is not None)
