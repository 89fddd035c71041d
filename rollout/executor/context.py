"""ForwardContext: what every layer of a model needs in one step, handed to `model.forward`."""

from __future__ import annotations

import torch

from ..attention.base import AttentionBackend
from ..attention.metadata import AttentionMetadata


class ForwardContext:
    """The step's positions, its attention metadata and backend, and what every layer would
    otherwise recompute: the rotary cos/sin of each table and the pool rows of the step's
    tokens' per-slot values (each computed on first use, once per step)."""

    __slots__ = ("positions", "meta", "attention", "_rotary", "_slot_rows")

    def __init__(self, positions: torch.Tensor, meta: AttentionMetadata,
                 attention: AttentionBackend) -> None:
        self.positions, self.meta, self.attention = positions, meta, attention
        self._rotary: dict = {}
        self._slot_rows: torch.Tensor | None = None

    def rotary(self, rope, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of the step's positions in table `rope` (a layers.RotaryEmbedding)."""
        cached = self._rotary.get(rope)
        if cached is None:
            cached = self._rotary[rope] = rope.lookup(self.positions, dtype)
        return cached

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, scale: float,
               softcap: float | None = None) -> torch.Tensor:
        """Store k/v [T, Hkv, D] in layer `layer`'s pool and attend q [T, Hq, D] over each
        request's context (the layer's sliding window applied by the backend)."""
        return self.attention.forward(q, k, v, layer, self.meta, scale, softcap)

    def store_slot_values(self, name: str, index: int, values: torch.Tensor) -> None:
        """Keep values [T, ...] of the step's tokens beside their K/V: entry `index` of the
        pool's per-slot array `name` (models/base.py slot_extras), at the tokens' out slots.
        No host synchronisation, so it can be captured in a CUDA graph."""
        pool = self.attention.pool
        if self._slot_rows is None:
            self._slot_rows = pool.extra_rows(self.meta.out_slots)
        pool.store_extra(name, index, self._slot_rows, values)
