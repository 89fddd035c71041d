"""An unmerged LoRA adapter's delta on a projection's output, in two kernels (the shrink and
expand of punica-style LoRA serving): s = x A^T for all the projection's blocks at once, then
each block's y[:, rows] += scale * s[:, cols] B[rows, cols]^T in place, block by block, so the
zeros of a block-diagonal B are never multiplied and no delta tensor is made.

Blocks (rollout/models/layers/lora.py LoraBlock) are given as tensors on the device: `rows`
[nb, 3] int32 (first output row, row count, first rank column), `ranks` [nb] int32 and `scales`
[nb] float32, so a launch needs no host values beyond the shapes (CUDA graphs capture it as is).
Both accumulate in float32 (x and y may be 16-bit; A and B are float32).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .row_invariant import row_dot


# T is not specialised: Triton compiles apart a call where it is 1, and a lone row must run the
# code a batch runs (EngineConfig.batch_invariant).
@triton.jit(do_not_specialize=["T"])
def _shrink_kernel(x, a, s, T, K, R, stride_xt, stride_ar, stride_st, PRECISION: tl.constexpr,
                   BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    pt, pr = tl.program_id(0), tl.program_id(1)
    t = pt * BLOCK_T + tl.arange(0, BLOCK_T)
    r = pr * BLOCK_R + tl.arange(0, BLOCK_R)
    acc = tl.zeros((BLOCK_T, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        xt = tl.load(x + t[:, None].to(tl.int64) * stride_xt + k[None, :],
                     mask=(t[:, None] < T) & (k[None, :] < K), other=0.0).to(tl.float32)
        at = tl.load(a + r[None, :] * stride_ar + k[:, None],
                     mask=(r[None, :] < R) & (k[:, None] < K), other=0.0)
        acc += row_dot(xt, at, tl.zeros((BLOCK_T, BLOCK_R), dtype=tl.float32), PRECISION)
    tl.store(s + t[:, None].to(tl.int64) * stride_st + r[None, :], acc,
             mask=(t[:, None] < T) & (r[None, :] < R))


@triton.jit(do_not_specialize=["T"])
def _expand_kernel(s, b, y, rows, ranks, scales, T, stride_st, stride_br, stride_yt,
                   PRECISION: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_R: tl.constexpr, RANK_TILES: tl.constexpr):
    pt, pn, blk = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    row0 = tl.load(rows + blk * 3)
    count = tl.load(rows + blk * 3 + 1)
    col0 = tl.load(rows + blk * 3 + 2)
    rank = tl.load(ranks + blk)
    scale = tl.load(scales + blk)
    if pn * BLOCK_N < count:
        t = pt * BLOCK_T + tl.arange(0, BLOCK_T)
        n = pn * BLOCK_N + tl.arange(0, BLOCK_N)
        delta = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
        # Over the rank a tile at a time: one tile as wide as a rank of 1024 needed 320 KiB of
        # shared memory, over what a GPU gives a block. Unrolled: a rank within one tile runs
        # straight-line code (a loop doubled its registers and shared memory).
        for r0 in tl.static_range(0, RANK_TILES * BLOCK_R, BLOCK_R):
            r = r0 + tl.arange(0, BLOCK_R)
            st = tl.load(s + t[:, None].to(tl.int64) * stride_st + col0 + r[None, :],
                         mask=(t[:, None] < T) & (r[None, :] < rank), other=0.0)
            bt = tl.load(b + (row0 + n[None, :]).to(tl.int64) * stride_br + col0 + r[:, None],
                         mask=(n[None, :] < count) & (r[:, None] < rank), other=0.0)
            delta = row_dot(st, bt, delta, PRECISION)  # the tiles' sums go on in one chain
        out = y + t[:, None].to(tl.int64) * stride_yt + row0 + n[None, :]
        keep = (t[:, None] < T) & (n[None, :] < count)
        base = tl.load(out, mask=keep, other=0.0).to(tl.float32)
        tl.store(out, (base + scale * delta).to(y.dtype.element_ty), mask=keep)


def _tile(n: int) -> int:
    return max(16, triton.next_power_of_2(n))  # tl.dot wants every dimension >= 16


# The expand's widest rank tile (80 KiB of shared memory at BLOCK_T 16, BLOCK_N 64): larger
# ranks are covered by several.
MAX_RANK_TILE = 256


def lora_shrink(x: torch.Tensor, a: torch.Tensor, precision: str = "ieee") -> torch.Tensor:
    """x [T, K] (unit stride within a row) times a [R, K] (float32, contiguous)'s transpose:
    [T, R] float32, new. `precision`: row_invariant.row_dot's (the tiles are the same for any
    T, so compiled a token's row never depends on the others; under the interpreter the
    batch-invariant mode passes "rows": row_invariant.dot_precision)."""
    num_tokens, k = x.shape
    rank = a.shape[0]
    if a.shape[1] != k or not a.is_contiguous() or a.dtype != torch.float32:
        raise ValueError(f"lora_shrink: a {tuple(a.shape)} {a.dtype} must be [R, {k}] float32, "
                         f"contiguous")
    if x.stride(1) != 1:
        raise ValueError(f"lora_shrink: x's rows must be unit-stride, got stride {x.stride(1)}")
    s = torch.empty(num_tokens, rank, dtype=torch.float32, device=x.device)
    if num_tokens:
        block_r = min(_tile(rank), 64)
        grid = (triton.cdiv(num_tokens, 16), triton.cdiv(rank, block_r))
        _shrink_kernel[grid](x, a, s, num_tokens, k, rank, x.stride(0), a.stride(0), s.stride(0),
                             PRECISION=precision, BLOCK_T=16, BLOCK_R=block_r, BLOCK_K=64)
    return s


def lora_expand_add(s: torch.Tensor, b: torch.Tensor, y: torch.Tensor, rows: torch.Tensor,
                    ranks: torch.Tensor, scales: torch.Tensor, max_rows: int,
                    max_rank: int, precision: str = "ieee") -> None:
    """y [T, N] += each block's scale * s[:, its columns] B[its rows, its columns]^T, in place
    (s [T, R] and b [N, R] float32, contiguous; y with unit stride within a row). `max_rows`
    and `max_rank`: the largest block's, which size the grid and the rank tile; `precision`:
    as lora_shrink's."""
    num_tokens = s.shape[0]
    if not (s.is_contiguous() and b.is_contiguous() and y.stride(1) == 1):
        raise ValueError("lora_expand_add: s, b must be contiguous and y's rows unit-stride")
    if num_tokens == 0 or rows.shape[0] == 0:
        return
    grid = (triton.cdiv(num_tokens, 16), triton.cdiv(max_rows, 64), rows.shape[0])
    block_r = min(_tile(max_rank), MAX_RANK_TILE)
    _expand_kernel[grid](s, b, y, rows, ranks, scales, num_tokens, s.stride(0), b.stride(0),
                         y.stride(0), PRECISION=precision, BLOCK_T=16, BLOCK_N=64,
                         BLOCK_R=block_r, RANK_TILES=triton.cdiv(max_rank, block_r))


def lora_add_ref(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, y: torch.Tensor,
                 blocks: list[tuple[int, int, int, int, float]]) -> None:
    """Torch reference: the same in place, blocks as (row, rows, col, rank, scale)."""
    s = x.float() @ a.t()
    for row, count, col, rank, scale in blocks:
        part = y[:, row:row + count]
        part.copy_((part.float() + scale * (s[:, col:col + rank] @ b[row:row + count,
                                                                     col:col + rank].t()))
                   .to(y.dtype))
