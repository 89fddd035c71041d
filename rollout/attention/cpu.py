"""The CPU attention backend (fp32, where rollout_kernels.cpu builds): the torch backend with
decode and verify rows, and extend chunks over a context at least twice their length (later
turns), handed to one C kernel call per layer that reads the pool in place
(kernels/cpu/paged_attention.c). Consecutive requests with leading slots in common
(siblings, a shared system prompt) read them once for all their rows; an extend chunk's queries
read their context once for all. Prefills keep the padded SDPA path of sdpa.py: a prefill's
queries see mostly one another, a causal matrix product.
"""

from __future__ import annotations

from itertools import accumulate

from rollout_kernels.cpu import paged_attention as kernel

from .metadata import AttentionMetadata
from .sdpa import TorchAttention
from .shared_prefix import MAX_SHARED_Q_LEN

# An extend chunk's queries x heads are rows one thread keeps while it reads each key block.
MAX_EXTEND_Q_LEN = 512

supported = kernel.supported


def serves(q_len: int, kv_len: int) -> bool:
    """Whether the kernel attends for a request of these lengths."""
    return q_len <= MAX_SHARED_Q_LEN or (q_len <= MAX_EXTEND_Q_LEN and kv_len >= 2 * q_len)


class CpuAttention(TorchAttention):
    def _kernel_rows(self, meta: AttentionMetadata) -> kernel.NativeRows | None:
        rows = [b for b, (q, kv) in enumerate(zip(meta.q_lens, meta.kv_lens)) if serves(q, kv)]
        if not rows:
            return None
        return kernel.NativeRows.of(
            rows, [0, *accumulate(meta.q_lens)], meta.q_lens, [0, *accumulate(meta.kv_lens)],
            meta.kv_lens, meta.kv_indices)

    def _sharing(self, meta, window, rows):
        # The kernel reads shared slots once itself: no sharing groups on the torch path.
        return [], 0, set(rows.rows) if rows is not None else set()

    def _attend_kernel_rows(self, q, k, v, k_pool, v_pool, out, rows, meta, scale, window,
                            softcap) -> None:
        kernel.paged_attention(q, k_pool, v_pool, out, rows, scale, window, softcap,
                               store=(k, v, meta.out_slots))
