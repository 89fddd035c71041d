"""The Triton attention backend (CUDA default): store_kv, then one varlen paged-attention
kernel for prefill, extend, decode and verify (kernels/paged_attention.py)."""

from __future__ import annotations

import torch

from kernels import paged_attention, store_kv

from .attention import AttentionBackend, AttentionMetadata


class TritonAttention(AttentionBackend):
    def plan(self, meta: AttentionMetadata) -> tuple[int, int]:
        # Launch sizes come from host-side lengths, so the kernels never synchronise.
        return meta.max_q_len, meta.max_kv_len

    def forward(self, q, k, v, layer, meta, scale):
        k_pool, v_pool = self.pool.k(layer), self.pool.v(layer)
        store_kv(k, v, k_pool, v_pool, meta.out_slots)
        out = torch.empty_like(q)
        max_q_len, max_kv_len = meta.plan
        paged_attention(q, k_pool, v_pool, out, meta.qo_indptr, meta.kv_indptr, meta.kv_indices,
                        sm_scale=scale, max_q_len=max_q_len, max_kv_len=max_kv_len)
        return out
