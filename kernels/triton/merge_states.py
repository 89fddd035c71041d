"""Merge partial attention results computed over disjoint KV ranges.

Split-KV decoding and the shared-prefix path both compute, for one query row, several partial
outputs `o_s` (already normalised by their own softmax sum) with their log-sum-exp `lse_s`.
The exact result is sum_s w_s * o_s with w_s = exp(lse_s - logsumexp_s(lse)). The lse values are
in base 2 (the attention kernel works with exp2), so the weights use exp2 too.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["num_splits"])  # no recompiling per split count
def _merge_states_kernel(
    part_out, part_lse, out, num_splits,
    stride_pt, stride_ph, stride_ps, stride_lt, stride_lh, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_ok = s < num_splits
    lse = tl.load(part_lse + t * stride_lt + h * stride_lh + s, mask=s_ok, other=float("-inf"))
    m = tl.max(lse, 0)
    # A row with no visible key in any split would give nan; keep it finite (it is padding).
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)
    o = tl.load(part_out + t * stride_pt + h * stride_ph + s[:, None] * stride_ps + d[None, :],
                mask=s_ok[:, None] & (d[None, :] < HEAD_DIM), other=0.0)
    total = tl.maximum(tl.sum(w, 0), 1e-30)
    res = tl.sum(o * w[:, None], 0) / total
    tl.store(out + t * stride_ot + h * stride_oh + d, res.to(out.dtype.element_ty),
             mask=d < HEAD_DIM)


def merge_states(part_out: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """part_out: [T, H, S, D] fp32; part_lse: [T, H, S] fp32 (base 2); out: [T, H, D]."""
    num_tokens, num_heads, num_splits, head_dim = part_out.shape
    if part_lse.shape != part_out.shape[:3]:
        raise ValueError(f"merge_states: part_lse {tuple(part_lse.shape)} must be "
                         f"{tuple(part_out.shape[:3])}, part_out's [T, H, S]")
    if out.shape != (num_tokens, num_heads, head_dim):
        raise ValueError(f"merge_states: out {tuple(out.shape)} must be "
                         f"{(num_tokens, num_heads, head_dim)}, part_out's [T, H, D]")
    for name, t in (("part_out", part_out), ("part_lse", part_lse), ("out", out)):
        if t.stride(-1) != 1:
            raise ValueError(f"merge_states: the last dimension of {name} must be contiguous "
                             f"(stride 1), got stride {t.stride(-1)}")
    if num_tokens == 0:
        return out
    _merge_states_kernel[(num_tokens, num_heads)](
        part_out, part_lse, out, num_splits,
        part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1), out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_S=triton.next_power_of_2(num_splits), num_warps=1 if head_dim <= 64 else 2,
    )
    return out
