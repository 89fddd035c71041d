"""Projections and RMSNorm whose every row's result is the same bits whatever the other rows
are (EngineConfig.batch_invariant on the Triton backend).

cuBLAS picks its algorithm, tile and split of the inner dimension by the matrix's shape, and
torch's row reductions split a row across blocks when there are few rows: a request's logits
then round differently alone and in a batch. Here the launch configuration is a function of
the weight's shape and the device alone, never of the row count: every row is reduced over k
in BLOCK_K steps in the same order, by the same instructions, in whatever tile and at whatever
place in it it lands (row_dot: under the interpreter that takes an explicit sum). fp32
multiplies in IEEE fp32 (no TF32: torch's default for fp32 matmuls); bf16/fp16 on the tensor
cores, accumulating in fp32 and rounding once, as cuBLAS.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def dot_precision(dtype: torch.dtype, on_gpu: bool) -> str:
    """row_dot's PRECISION for a batch-invariant matmul of `dtype` inputs: "rows" (the products
    summed explicitly) under the interpreter; compiled, "ieee" for fp32 (no TF32) and tl.dot's
    default for 16-bit inputs (for which it means nothing)."""
    if not on_gpu:
        return "rows"
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def row_dot(a, b, acc, PRECISION: tl.constexpr):
    """acc + a @ b (a [M, K], b [K, N], acc fp32), each row of the result rounded alike
    wherever it sits in the tile. Compiled, tl.dot: the tensor cores treat every row alike
    (`PRECISION` "ieee" for fp32 inputs: no TF32). Under the interpreter tl.dot is numpy's
    matmul, and OpenBLAS on AVX2 hosts rounds a row by its place in the matrix (tests/
    attention/test_invariant_attention.py shows it): there (PRECISION "rows") the products
    are summed over k by an elementwise reduction, the same operations for every row."""
    if PRECISION == "rows":
        return acc + tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
    return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit(do_not_specialize=["M"])
def _linear_kernel(x, w, bias, y, M, N, K, stride_xm, stride_wn, stride_ym,
                   HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # M is not specialised: Triton compiles a separate kernel for an argument equal to 1 or a
    # multiple of 16, and a lone row must run the code a batch runs.
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = rm[:, None] < M, rn[None, :] < N
    x_rows = x + rm[:, None].to(tl.int64) * stride_xm
    w_cols = w + rn[None, :].to(tl.int64) * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(x_rows + rk[None, :], mask=m_ok & (rk[None, :] < K), other=0.0)
        b = tl.load(w_cols + rk[:, None], mask=n_ok & (rk[:, None] < K), other=0.0)
        acc = row_dot(a, b, acc, PRECISION)
    if HAS_BIAS:  # in fp32 before the one rounding, as F.linear's epilogue
        acc += tl.load(bias + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    tl.store(y + rm[:, None].to(tl.int64) * stride_ym + rn[None, :],
             acc.to(y.dtype.element_ty), mask=m_ok & n_ok)


def _linear_config(on_gpu: bool) -> tuple[int, int, int, int]:
    """BLOCK_M, BLOCK_N, BLOCK_K, num_warps: one configuration for every call on a device.
    Untuned (no GPU was lent when this was written); under the interpreter, tiles large
    enough that it runs few programs."""
    return (64, 64, 32, 4) if on_gpu else (32, 64, 64, 1)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
           ) -> torch.Tensor:
    """F.linear(x, weight, bias) with rows that do not depend on each other: x [..., K] (any
    leading shape), weight [N, K], bias [N] or None; out [..., N] in x's dtype."""
    k = x.shape[-1]
    n = weight.shape[0]
    if weight.shape[1] != k or weight.dtype != x.dtype:
        raise ValueError(f"linear: weight {tuple(weight.shape)} {weight.dtype} does not fit "
                         f"x [..., {k}] {x.dtype}")
    if bias is not None:
        if bias.shape != (n,):
            raise ValueError(f"linear: bias {tuple(bias.shape)} must be ({n},): one per output")
        bias = bias.contiguous()  # the kernel reads output j's bias at offset j
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    y = torch.empty(rows.shape[0], n, dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        block_m, block_n, block_k, warps = _linear_config(x.is_cuda)
        grid = (triton.cdiv(rows.shape[0], block_m), triton.cdiv(n, block_n))
        _linear_kernel[grid](
            rows, weight, y if bias is None else bias, y, rows.shape[0], n, k, rows.stride(0),
            weight.stride(0), y.stride(0), HAS_BIAS=bias is not None,
            PRECISION=dot_precision(x.dtype, x.is_cuda), BLOCK_M=block_m,
            BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps)
    return y.reshape(*x.shape[:-1], n)


@triton.jit
def _rms_norm_kernel(x, w, y, D, stride_x, stride_y, eps, OFFSET: tl.constexpr,
                     BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    ok = d < D
    h = tl.load(x + row * stride_x + d, mask=ok, other=0.0).to(tl.float32)
    h = tl.math.div_rn(h, tl.sqrt_rn(tl.sum(h * h, axis=0) / D + eps))
    scale = tl.load(w + d, mask=ok, other=0.0)
    if OFFSET:  # Gemma: times (1 + weight) in fp32, then cast
        out = h * (1.0 + scale.to(tl.float32))
    else:  # cast back to the input's dtype, then times the weight
        out = scale * h.to(x.dtype.element_ty)
    tl.store(y + row * stride_y + d, out.to(y.dtype.element_ty), mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool) -> torch.Tensor:
    """RMSNorm of each row of x [..., D] (models/layers/norm.py's two forms, `offset` for
    Gemma's), one program a row: the sum of squares in one fixed order. Out: x's dtype with
    `offset`, else the dtype of weight times x."""
    dim = x.shape[-1]
    if weight.shape != (dim,):
        raise ValueError(f"rms_norm: weight {tuple(weight.shape)} must be ({dim},): one per "
                         f"feature of x")
    rows = x.reshape(-1, dim)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    dtype = x.dtype if offset else torch.result_type(weight, x)
    y = torch.empty(rows.shape, dtype=dtype, device=x.device)
    if rows.shape[0]:
        block = triton.next_power_of_2(dim)
        _rms_norm_kernel[(rows.shape[0],)](
            rows, weight.contiguous(), y, dim, rows.stride(0), y.stride(0), eps, OFFSET=offset,
            BLOCK_D=block, num_warps=4 if block <= 2048 else 8)
    return y.reshape(x.shape)


@triton.jit
def _row_sum_kernel(x, out, N, stride_x, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, N, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        acc += tl.load(x + row * stride_x + cols, mask=cols < N, other=0.0).to(tl.float32)
    tl.store(out + row, tl.sum(acc, axis=0))


def row_sum(x: torch.Tensor) -> torch.Tensor:
    """x.sum(-1, keepdim=True) in float32 (whatever x's dtype), one program a row adding in
    one fixed order (4,096 lanes, each summing the elements 4,096 apart, then the lanes in a
    tree): torch's CUDA sum splits a row across blocks when there are few rows, so a lone
    row's sum rounds otherwise than in a batch. A vocabulary of 152k is 38 steps a program."""
    n = x.shape[-1]
    rows = x.reshape(-1, n)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape[0], dtype=torch.float32, device=x.device)
    if rows.shape[0]:
        _row_sum_kernel[(rows.shape[0],)](rows, out, n, rows.stride(0), BLOCK=4096,
                                          num_warps=8)
    return out.reshape(*x.shape[:-1], 1)
