"""The attention backend interface and the torch reference backend.

Every step runs the model once over a flat batch described by `AttentionMetadata` (the format
of DESIGN.md): request b computes queries `qo_indptr[b]:qo_indptr[b+1]` of the flat token axis
and attends to the pool slots `kv_indices[kv_indptr[b]:kv_indptr[b+1]]`, its whole context in
position order with the new tokens last. Query i of a request sees context positions
j <= i + kv_len - q_len. The same format serves prefill, chunked prefill, decode and verify.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any

import torch
import torch.nn.functional as F

from .kv_pool import KVPool


@dataclass
class AttentionMetadata:
    qo_indptr: torch.Tensor  # int32 [B+1]
    kv_indptr: torch.Tensor  # int32 [B+1]
    kv_indices: torch.Tensor  # int64 [sum kv_len]
    out_slots: torch.Tensor  # int64 [T]: where the new tokens' K/V go
    q_lens: list[int]
    kv_lens: list[int]
    # Per request, on the host: its sample group, and how many leading context slots it holds
    # in common with every other request of that group (the cached prompt; 0 = none known).
    # Backends that read a group's shared K/V once use these; empty lists mean no grouping.
    groups: list[str] = field(default_factory=list)
    shared_lens: list[int] = field(default_factory=list)
    plan: Any = field(default=None)  # the backend's per-step precomputation, shared by layers

    @property
    def max_q_len(self) -> int:
        return max(self.q_lens)

    @property
    def max_kv_len(self) -> int:
        return max(self.kv_lens)


class AttentionBackend(ABC):
    def __init__(self, pool: KVPool) -> None:
        self.pool = pool

    @abstractmethod
    def plan(self, meta: AttentionMetadata) -> Any:
        """Work done once per step for all layers (index maps, masks, split sizes)."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """Store k/v [T, Hkv, D] at meta.out_slots, attend q [T, Hq, D]; returns [T, Hq, D]."""


def indptr(lens: list[int], device) -> torch.Tensor:
    """[0, l0, l0 + l1, ...] as int32 on `device`."""
    return torch.tensor([0, *accumulate(lens)], dtype=torch.int32, device=device)


def ranges(starts: list[int], lens: list[int], device) -> torch.Tensor:
    """arange(s, s + n) for each (s, n), concatenated; built on `device` from O(B) host data
    (output_size keeps repeat_interleave from reading the total back)."""
    total = sum(lens)
    lens_t = torch.tensor(lens, device=device)
    offsets = lens_t.cumsum(0) - lens_t  # where each range begins in the output
    shift = torch.tensor(starts, device=device) - offsets
    return torch.arange(total, device=device) + torch.repeat_interleave(shift, lens_t,
                                                                        output_size=total)


@dataclass
class _Segment:
    """Requests padded together: q_index [b, mq] into the flat axis, kv_slots [b, mk]."""

    q_index: torch.Tensor
    q_valid: torch.Tensor
    q_flat: torch.Tensor
    kv_slots: torch.Tensor
    mask: torch.Tensor  # bool [b, 1, mq, mk]


class TorchAttention(AttentionBackend):
    """Gather by kv_indices, pad, one SDPA with a mask. Decode rows (one query) and longer
    rows are padded separately so a prefill does not pad every decode to its length."""

    def plan(self, meta: AttentionMetadata) -> list[_Segment]:
        device = meta.kv_indices.device
        q_lens = torch.tensor(meta.q_lens)
        kv_lens = torch.tensor(meta.kv_lens)
        q_start = torch.tensor([0, *accumulate(meta.q_lens)][:-1])
        kv_start = torch.tensor([0, *accumulate(meta.kv_lens)][:-1])
        segments = []
        decode = q_lens == 1
        for rows in (decode.nonzero().flatten(), (~decode).nonzero().flatten()):
            if rows.numel():
                segments.append(self._segment(rows, q_lens, kv_lens, q_start, kv_start,
                                              meta.kv_indices, device))
        return segments

    @staticmethod
    def _segment(rows, q_lens, kv_lens, q_start, kv_start, kv_indices, device) -> _Segment:
        ql, kl = q_lens[rows], kv_lens[rows]
        mq, mk = int(ql.max()), int(kl.max())
        qi, kj = torch.arange(mq), torch.arange(mk)
        # Padding points at the row's own last query / context token: a masked position
        # still multiplies its value by 0, and 0 * NaN from a stranger's slot would leak.
        q_valid = qi[None, :] < ql[:, None]
        q_index = q_start[rows][:, None] + torch.minimum(qi[None, :], ql[:, None] - 1)
        kv_valid = kj[None, :] < kl[:, None]
        kv_pos = kv_start[rows][:, None] + torch.minimum(kj[None, :], kl[:, None] - 1)
        causal = kj[None, None, :] <= qi[None, :, None] + (kl - ql)[:, None, None]
        mask = kv_valid[:, None, :] & causal
        mask[:, :, 0] |= ~q_valid  # padded query rows attend somewhere, so no NaN
        q_index = q_index.to(device)
        q_valid = q_valid.to(device)
        return _Segment(q_index=q_index, q_valid=q_valid, q_flat=q_index[q_valid],
                        kv_slots=kv_indices[kv_pos.to(device)],
                        mask=mask[:, None].to(device))

    def forward(self, q, k, v, layer, meta, scale):
        k_pool, v_pool = self.pool.k(layer), self.pool.v(layer)
        k_pool.index_copy_(0, meta.out_slots, k)
        v_pool.index_copy_(0, meta.out_slots, v)
        out = torch.empty_like(q)
        for seg in meta.plan:
            qs = _gather(q, seg.q_index)
            ks, vs = _gather(k_pool, seg.kv_slots), _gather(v_pool, seg.kv_slots)
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=seg.mask, scale=scale,
                                               enable_gqa=qs.shape[1] != ks.shape[1])
            out[seg.q_flat] = o.transpose(1, 2)[seg.q_valid]
        return out


def _gather(rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """rows [N, H, D] at index [b, m] -> [b, H, m, D] (index_select is ~2x faster on CPU than
    advanced indexing)."""
    b, m = index.shape
    return rows.index_select(0, index.flatten()).view(b, m, *rows.shape[1:]).transpose(1, 2)


def make_backend(name: str, pool: KVPool) -> AttentionBackend:
    if name == "auto":
        name = "triton" if pool.device.type == "cuda" else "torch"
    if name == "torch":
        return TorchAttention(pool)
    from .triton_attention import (
        TritonAttention,  # triton is imported only when asked for
    )

    return TritonAttention(pool)
