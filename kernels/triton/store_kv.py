"""Scatter the new tokens' K/V rows into the paged KV pool (page size 1).

The model computes K/V for the step's T new tokens; `out_slots[t]` names the pool slot that
token t owns. A negative slot marks a padding token (a CUDA-graph batch padded to a fixed size)
whose K/V must not land anywhere.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .paged_attention import INDEX_DTYPES, _interpreting, check_heads_contiguous


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
    """k, v: [T, Hkv, D]; k_pool, v_pool: [S, Hkv, D]; out_slots: [T] int32/int64 (negative =
    skip).

    k and v may be strided views (e.g. slices of a fused QKV output) as long as the head
    dimension is contiguous. No host synchronisation, so it can sit inside a CUDA graph.
    Shapes, dtypes and strides are checked (ValueError); slots below S are the caller's
    contract, checked (IndexError) only under Triton's CPU interpreter: on a GPU reading them
    would wait for the device on every layer.
    """
    if k.dim() != 3 or v.shape != k.shape:
        raise ValueError(f"store_kv: k {tuple(k.shape)} and v {tuple(v.shape)} must be one "
                         f"[T, Hkv, D] shape")
    if k_pool.dim() != 3 or v_pool.shape != k_pool.shape:
        raise ValueError(f"store_kv: k_pool {tuple(k_pool.shape)} and v_pool "
                         f"{tuple(v_pool.shape)} must be one [S, Hkv, D] shape")
    num_tokens, num_heads, head_dim = k.shape
    if k_pool.shape[1:] != k.shape[1:]:
        raise ValueError(f"store_kv: k {tuple(k.shape)} does not fit the pools' rows "
                         f"{tuple(k_pool.shape[1:])}")
    if not k.dtype == v.dtype == k_pool.dtype == v_pool.dtype:
        raise ValueError(f"store_kv: k and v {k.dtype} / {v.dtype} must be the pools' "
                         f"{k_pool.dtype} / {v_pool.dtype}")
    check_heads_contiguous("store_kv", k=k, v=v, k_pool=k_pool, v_pool=v_pool)
    if out_slots.dtype not in INDEX_DTYPES:
        raise ValueError(f"store_kv: out_slots must hold int32 or int64, got {out_slots.dtype}")
    if out_slots.shape != (num_tokens,) or not out_slots.is_contiguous():
        raise ValueError(f"store_kv: out_slots {tuple(out_slots.shape)} must be "
                         f"({num_tokens},), contiguous: one per token")
    if num_tokens == 0:
        return
    if _interpreting():
        last = int(out_slots.argmax())
        if out_slots[last] >= k_pool.shape[0]:
            raise IndexError(f"store_kv: slot {int(out_slots[last])} of token {last}, past the "
                             f"pool's {k_pool.shape[0]} slots")
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
