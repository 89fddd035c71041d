"""Scatter the new tokens' K/V rows into the paged KV pool (page size 1).

The model computes K/V for the step's T new tokens; `out_slots[t]` names the pool slot that
token t owns. A negative slot marks a padding token (a CUDA-graph batch padded to a fixed size)
whose K/V must not land anywhere.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(
    k, v, k_pool, v_pool, out_slots,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kps, stride_kph, stride_vps, stride_vph,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0)
    # int64 before multiplying: slot * row_stride passes 2**31 in pools of a few million slots.
    slot = tl.load(out_slots + t).to(tl.int64)
    if slot >= 0:
        h = tl.arange(0, BLOCK_H)[:, None]
        d = tl.arange(0, BLOCK_D)[None, :]
        mask = (h < NUM_HEADS) & (d < HEAD_DIM)
        t64 = t.to(tl.int64)
        # The head dimension is contiguous (stride 1) in every tensor: checked by the wrapper.
        kr = tl.load(k + t64 * stride_kt + h * stride_kh + d, mask=mask)
        vr = tl.load(v + t64 * stride_vt + h * stride_vh + d, mask=mask)
        tl.store(k_pool + slot * stride_kps + h * stride_kph + d, kr, mask=mask)
        tl.store(v_pool + slot * stride_vps + h * stride_vph + d, vr, mask=mask)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
             out_slots: torch.Tensor) -> None:
    """k, v: [T, Hkv, D]; k_pool, v_pool: [S, Hkv, D]; out_slots: [T] int (negative = skip).

    k and v may be strided views (e.g. slices of a fused QKV output) as long as the head
    dimension is contiguous. No host synchronisation, so it can sit inside a CUDA graph.
    """
    num_tokens, num_heads, head_dim = k.shape
    assert v.shape == k.shape and out_slots.shape == (num_tokens,)
    assert k_pool.shape[1:] == (num_heads, head_dim) and v_pool.shape == k_pool.shape
    for t in (k, v, k_pool, v_pool):
        assert t.stride(-1) == 1, "the head dimension must be contiguous"
    assert k.dtype == k_pool.dtype and v.dtype == v_pool.dtype
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        k, v, k_pool, v_pool, out_slots,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_pool.stride(0), k_pool.stride(1), v_pool.stride(0), v_pool.stride(1),
        NUM_HEADS=num_heads, HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        num_warps=4 if num_heads * head_dim >= 1024 else 1,
    )


def store_kv_ref(k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                 out_slots: torch.Tensor) -> None:
    """Torch reference of `store_kv`."""
    keep = out_slots >= 0
    slots = out_slots[keep].long()
    k_pool[slots] = k[keep]
    v_pool[slots] = v[keep]
