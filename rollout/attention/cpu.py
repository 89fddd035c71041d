"""The CPU attention backend (where rollout_kernels.cpu builds): the torch backend with
decode and verify rows, and extend chunks over a context at least twice their length (later
turns), handed to one C kernel call per layer (kernels/cpu/paged_attention.c). Consecutive
requests with leading slots in common (siblings, a shared system prompt) read them once for all
their rows; an extend chunk's queries read their context once for all. Prefills keep the padded
SDPA path of sdpa.py: a prefill's queries see mostly one another, a causal matrix product.

The kernel reads fp32 pools in place. A bf16 or fp16 model keeps its pool in its dtype; each
layer then reads the kernel rows' distinct slots once into fp32 (exact) and attends there, in fp32,
rounding the kernel rows' output to the model's dtype once, as the batch-invariant backend
does (invariant.py): measured faster than its dtype's SDPA on the CPU (docs/benchmarks.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch

from rollout_kernels.cpu import paged_attention as kernel

from .metadata import AttentionMetadata, ranges
from .sdpa import TorchAttention
from .shared_prefix import MAX_SHARED_Q_LEN

# An extend chunk's queries x heads are rows one thread keeps while it reads each key block.
MAX_EXTEND_Q_LEN = 512
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def supported(device: torch.device, dtype: torch.dtype) -> bool:
    return dtype in DTYPES and kernel.supported(device, torch.float32)


def serves(q_len: int, kv_len: int) -> bool:
    """Whether the kernel attends for a request of these lengths."""
    return q_len <= MAX_SHARED_Q_LEN or (q_len <= MAX_EXTEND_Q_LEN and kv_len >= 2 * q_len)


@dataclass
class KernelRows:
    rows: kernel.NativeRows
    # Off fp32: the distinct slots of the rows' contexts (int64 [U]), which `rows` index
    # instead of the pool's, and the rows' queries (int64, flat positions).
    slots: torch.Tensor | None = None
    queries: torch.Tensor | None = None


class CpuAttention(TorchAttention):
    def _kernel_rows(self, meta: AttentionMetadata) -> KernelRows | None:
        rows = [b for b, (q, kv) in enumerate(zip(meta.q_lens, meta.kv_lens)) if serves(q, kv)]
        if not rows:
            return None
        q_starts, kv_starts = [0, *accumulate(meta.q_lens)], [0, *accumulate(meta.kv_lens)]
        if self.pool.dtype == torch.float32:
            return KernelRows(kernel.NativeRows.of(rows, q_starts, meta.q_lens, kv_starts,
                                                   meta.kv_lens, meta.kv_indices))
        # Only the served rows' contexts: a prefill's beside them stays with SDPA.
        device = meta.kv_indices.device
        served = ranges([kv_starts[b] for b in rows], [meta.kv_lens[b] for b in rows], device)
        slots, local = distinct_slots(meta.kv_indices[served])
        positions = torch.zeros_like(meta.kv_indices)
        positions[served] = local
        queries = ranges([q_starts[b] for b in rows], [meta.q_lens[b] for b in rows], device)
        return KernelRows(kernel.NativeRows.of(rows, q_starts, meta.q_lens, kv_starts,
                                               meta.kv_lens, positions), slots, queries)

    def _sharing(self, meta, window, rows):
        # The kernel reads shared slots once itself: no sharing groups on the torch path.
        return [], 0, set(rows.rows.rows) if rows is not None else set()

    def _attend_kernel_rows(self, q, k, v, k_pool, v_pool, out, rows, meta, scale, window,
                            softcap) -> None:
        if rows.slots is None:
            kernel.paged_attention(q, k_pool, v_pool, out, rows.rows, scale, window, softcap,
                                   store=(k, v, meta.out_slots))
            return
        out32 = attend_over_copies(q, k, v, k_pool, v_pool, meta.out_slots, rows.slots,
                                   rows.rows, scale, window, softcap)
        out[rows.queries] = out32[rows.queries].to(out.dtype)


def distinct_slots(kv_indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the step's distinct slots, ascending; kv_indices as positions among them). Ascending
    keeps the pool's order: runs of consecutive slots stay runs for the kernel."""
    return torch.unique(kv_indices, return_inverse=True)


def attend_over_copies(q, k, v, k_pool, v_pool, out_slots, slots, rows, scale, window,
                       softcap, invariant: bool = False) -> torch.Tensor:
    """A 16-bit pool's attention by the fp32 kernel: the step's K/V stored at `out_slots`,
    then `slots` read into fp32 (exact) and `rows` (indexing them) attended there. Returns
    the fp32 output [T, Hq, D], written for `rows` only."""
    k_pool.index_copy_(0, out_slots, k)
    v_pool.index_copy_(0, out_slots, v)
    keys = k_pool.index_select(0, slots).float()
    values = v_pool.index_select(0, slots).float()
    out = torch.empty(q.shape, dtype=torch.float32)
    kernel.paged_attention(q.float(), keys, values, out, rows, scale, window, softcap,
                           invariant=invariant)
    return out
