"""Batch-invariant attention on the CPU (EngineConfig.batch_invariant): every row of every
step, prefill, extend, decode and verify alike, goes through the C kernel in its invariant
mode (kernels/cpu/paged_attention.c): a row's keys are read in blocks that start at multiples
of the kernel's block, and every score is summed in one order, so a row's output is the same
bits whatever else the step holds, whether its prompt came from the radix cache or was just
prefilled, and however the scheduler cut its prefill into chunks.

The kernel reads fp32 pools. A bf16 or fp16 model stores its K/V in its own dtype as usual;
each layer then reads the step's distinct slots once into fp32 (exact) and attends there, in
fp32, rounding the output to the model's dtype once.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch

from rollout_kernels.cpu import paged_attention as kernel

from .base import AttentionBackend
from .cpu import attend_over_copies, distinct_slots
from .metadata import AttentionMetadata


@dataclass
class InvariantPlan:
    rows: kernel.NativeRows
    # Off fp32: the step's distinct slots (int64 [U]); `rows` then index them, not the pool.
    slots: torch.Tensor | None = None


class InvariantCpuAttention(AttentionBackend):
    def plan(self, meta: AttentionMetadata) -> InvariantPlan:
        everyone = list(range(len(meta.q_lens)))
        q_starts, kv_starts = [0, *accumulate(meta.q_lens)], [0, *accumulate(meta.kv_lens)]
        if self.pool.dtype == torch.float32:
            return InvariantPlan(kernel.NativeRows.of(everyone, q_starts, meta.q_lens,
                                                      kv_starts, meta.kv_lens, meta.kv_indices))
        slots, local = distinct_slots(meta.kv_indices)
        return InvariantPlan(kernel.NativeRows.of(everyone, q_starts, meta.q_lens, kv_starts,
                                                  meta.kv_lens, local), slots)

    def forward(self, q, k, v, layer, meta, scale, softcap=None):
        plan: InvariantPlan = meta.plan
        k_pool, v_pool = self.pool.k(layer), self.pool.v(layer)
        window = self.windows[layer]
        if plan.slots is None:
            out = torch.empty(q.shape, dtype=q.dtype)
            kernel.paged_attention(q, k_pool, v_pool, out, plan.rows, scale, window, softcap,
                                   store=(k, v, meta.out_slots), invariant=True)
            return out
        out = attend_over_copies(q, k, v, k_pool, v_pool, meta.out_slots, plan.slots,
                                 plan.rows, scale, window, softcap, invariant=True)
        return out.to(q.dtype)
