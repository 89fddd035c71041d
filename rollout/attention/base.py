"""The attention backend interface.

Every step runs the model once over a flat batch described by `AttentionMetadata`
(metadata.py; docs/architecture.md, "The step's flat batch"): request b computes queries `qo_indptr[b]:qo_indptr[b+1]` of the flat token axis
and attends to the pool slots `kv_indices[kv_indptr[b]:kv_indptr[b+1]]`, its whole context in
position order with the new tokens last. Query i of a request sees context positions
j <= i + kv_len - q_len. The same format serves prefill, chunked prefill, decode and verify.

A layer with a sliding window W (the model's KV layout, given to the backend) sees only the W
latest of those: j > i + kv_len - q_len - W. Its K/V stay in the pool all the same (the radix
tree and the slot table keep every slot; the global layers of the same tokens need them), the
backend just masks what lies outside the window.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import torch

from ..kv.pool import KVPool
from .metadata import AttentionMetadata


class AttentionBackend(ABC):
    def __init__(self, pool: KVPool, windows: Sequence[int | None] | None = None) -> None:
        """`windows`: each layer's sliding window (None: global), the model's
        KVLayout.windows; omitted, every layer is global."""
        self.pool = pool
        self.windows = tuple(windows) if windows is not None else (None,) * pool.num_layers
        if len(self.windows) != pool.num_layers:
            raise ValueError(f"windows: {len(self.windows)} for {pool.num_layers} layers")

    @abstractmethod
    def plan(self, meta: AttentionMetadata) -> Any:
        """Work done once per step for all layers (index maps, masks, split sizes)."""

    def graph_plan(self, batch_size: int, max_kv_len: int) -> Any:
        """The plan of a decode step captured in a CUDA graph: fixed for every replay, so it may
        depend on nothing but the bucket's batch size and the longest context allowed."""
        raise NotImplementedError(f"{type(self).__name__} cannot be captured in CUDA graphs")

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                meta: AttentionMetadata, scale: float,
                softcap: float | None = None) -> torch.Tensor:
        """Store k/v [T, Hkv, D] at meta.out_slots, attend q [T, Hq, D]; returns [T, Hq, D].
        `softcap`: scores become softcap * tanh(scores / softcap) before the mask (Gemma 2)."""

    def distinct_windows(self) -> list[int]:
        return sorted({w for w in self.windows if w is not None})
