"""Fused MoE: the routed experts of a sparse MLP block over one step's tokens.

x [T, H]; token t goes to the k experts `topk_ids[t]` with weights `topk_weights[t]` (fp32).
Expert e holds `w_gate_up[e]` [2I, H] (gate rows, then up rows: Hugging Face's stacked layout)
and `w_down[e]` [H, I]:

    out[t] = sum_j  w[t, j] * down_e(act(gate_e(x_t)) * up_e(x_t)),   e = topk_ids[t, j]

1. `align` (torch ops, no host synchronisation, so a decode step can sit in a CUDA graph): the
   T*k (token, choice) pairs sorted by expert, each expert's run padded to a multiple of
   BLOCK_M: `sorted_pairs` (padding rows hold T*k) and `block_expert` (the expert of each block
   of BLOCK_M rows, -1 past the last run). An expert no token chose has no block.
2. `_gate_up_kernel`: a program per (block of one expert's pairs, BLOCK_N columns of I): the
   pairs' token rows times the expert's gate and up weights (a grouped GEMM), act(gate) * up
   written to h [T*k, I] at each pair's row.
3. `_down_kernel`: per (block, BLOCK_N columns of H): h rows times the expert's down weight; the
   epilogue multiplies by the pair's top-k weight and writes y [T*k, H].
4. combine: y.view(T, k, H) summed over k in fp32, in a fixed order: no atomics, so a token's
   output does not depend on which other tokens share its experts.

An unmerged LoRA adapter on gate-up or down (rollout/models/layers/expert_lora.py) is two more
grouped GEMMs over the same sorted pairs (`_pair_matmul_kernel`: the shrink by the pair's
expert's A, the expand by its B, fp32), whose delta per pair the gate-up or down kernel adds to
its accumulator before rounding.

Rounding points, the same as the torch path it is tested against (rollout/models/layers/moe.py
moe_torch, tests/kernels/test_kernels_fused_moe.py) and as transformers' experts: gate, up, h and each
down projection are rounded to the model dtype, and so is each weighted contribution; the k
contributions are summed in fp32 (transformers sums in the model dtype: the same in fp32, one
rounding apart in half precision). Activation: SiLU (Qwen3-MoE, Mixtral); GELU (tanh) too.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .row_invariant import dot_precision, row_dot

ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


@triton.jit
def _activate(g, ACT: tl.constexpr):
    if ACT == "silu":
        return g * tl.sigmoid(g)
    # gelu, tanh approximation
    inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)
    return 0.5 * g * (1.0 + (2.0 * tl.sigmoid(2.0 * inner) - 1.0))


@triton.jit
def _tile(sorted_pairs, num_pairs, N: tl.constexpr, BLOCK_M: tl.constexpr,
          BLOCK_N: tl.constexpr):
    """This program's BLOCK_M sorted pairs (`valid`: not padding) and BLOCK_N output columns of
    N (`n_ok`: inside N)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_pairs + rows).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    return pair, pair < num_pairs, n, n < N


@triton.jit
def _expert_matmul(a, a_rows, stride_a, valid, w_e, stride_wn, stride_wk, n, n_ok,
                   K: tl.constexpr, UP_ROWS: tl.constexpr, DOT_PRECISION: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The grouped GEMM tile, fp32: rows `a_rows` of a [., K] times rows `n` of one expert's
    weight w_e [., K], transposed, loaded as [BLOCK_K, BLOCK_N] tiles. With UP_ROWS, also times
    rows n + UP_ROWS (the up half of gate-up) on the same loads of a; else the second result
    is zeros."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_ok = kk < K
        a_tile = tl.load(a + a_rows[:, None] * stride_a + kk[None, :],
                         mask=valid[:, None] & k_ok[None, :], other=0.0)
        w_tile = w_e + n[None, :] * stride_wn + kk[:, None] * stride_wk
        w_ok = k_ok[:, None] & n_ok[None, :]
        acc = row_dot(a_tile, tl.load(w_tile, mask=w_ok, other=0.0), acc, DOT_PRECISION)
        if UP_ROWS:
            acc_up = row_dot(a_tile, tl.load(w_tile + UP_ROWS * stride_wn, mask=w_ok, other=0.0),
                             acc_up, DOT_PRECISION)
    return acc, acc_up


# num_pairs is not specialised: Triton compiles apart a call where it is 1 (one token, k = 1),
# and a lone token must run the code a batch runs (EngineConfig.batch_invariant).
@triton.jit(do_not_specialize=["num_pairs"])
def _gate_up_kernel(x, w, h, delta, sorted_pairs, block_expert, num_pairs,
                    stride_xt, stride_we, stride_wn, stride_wk, stride_ht, stride_dt,
                    TOP_K: tl.constexpr, HIDDEN: tl.constexpr, INTER: tl.constexpr,
                    ACT: tl.constexpr, HAS_DELTA: tl.constexpr, DOT_PRECISION: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    e = tl.load(block_expert + tl.program_id(0)).to(tl.int64)
    if e < 0:
        return
    pair, valid, n, n_ok = _tile(sorted_pairs, num_pairs, INTER, BLOCK_M, BLOCK_N)
    acc_gate, acc_up = _expert_matmul(x, pair // TOP_K, stride_xt, valid, w + e * stride_we,
                                      stride_wn, stride_wk, n, n_ok, HIDDEN, INTER,
                                      DOT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K)
    if HAS_DELTA:  # a LoRA adapter's gate and up deltas, fp32 [T*k, 2I], before the rounding
        d = delta + pair[:, None] * stride_dt + n[None, :]
        ok = valid[:, None] & n_ok[None, :]
        acc_gate += tl.load(d, mask=ok, other=0.0)
        acc_up += tl.load(d + INTER, mask=ok, other=0.0)
    dtype = h.dtype.element_ty
    gate = acc_gate.to(dtype).to(tl.float32)
    up = acc_up.to(dtype).to(tl.float32)
    act = _activate(gate, ACT).to(dtype).to(tl.float32)
    out = (act * up).to(dtype)
    tl.store(h + pair[:, None] * stride_ht + n[None, :], out,
             mask=valid[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["num_pairs"])
def _down_kernel(h, w, y, weights, delta, sorted_pairs, block_expert, num_pairs,
                 stride_ht, stride_we, stride_wn, stride_wk, stride_yt, stride_dt,
                 HIDDEN: tl.constexpr, INTER: tl.constexpr, HAS_DELTA: tl.constexpr,
                 DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    e = tl.load(block_expert + tl.program_id(0)).to(tl.int64)
    if e < 0:
        return
    pair, valid, n, n_ok = _tile(sorted_pairs, num_pairs, HIDDEN, BLOCK_M, BLOCK_N)
    acc, _ = _expert_matmul(h, pair, stride_ht, valid, w + e * stride_we, stride_wn, stride_wk,
                            n, n_ok, INTER, 0, DOT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K)
    if HAS_DELTA:  # a LoRA adapter's down delta, fp32 [T*k, H], before the rounding
        acc += tl.load(delta + pair[:, None] * stride_dt + n[None, :],
                       mask=valid[:, None] & n_ok[None, :], other=0.0)
    dtype = y.dtype.element_ty
    weight = tl.load(weights + pair, mask=valid, other=0.0)
    out = (acc.to(dtype).to(tl.float32) * weight[:, None]).to(dtype)
    tl.store(y + pair[:, None] * stride_yt + n[None, :], out, mask=valid[:, None] & n_ok[None, :])


@triton.jit
def _pair_matmul_kernel(a, w, out, sorted_pairs, block_expert, num_pairs, scale,
                        stride_at, stride_we, stride_wn, stride_wk, stride_ot,
                        ROWS_PER_A: tl.constexpr, K: tl.constexpr, N: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[p] = scale * a[p // ROWS_PER_A] @ w[e]^T for each pair p of expert e, fp32: a LoRA
    adapter's shrink (a: tokens, w: A [E, r, in]) or expand (a: the shrunk pairs, w: B
    [E, out, r]) as a grouped GEMM over the same sorted pairs as the experts."""
    e = tl.load(block_expert + tl.program_id(0)).to(tl.int64)
    if e < 0:
        return
    pair, valid, n, n_ok = _tile(sorted_pairs, num_pairs, N, BLOCK_M, BLOCK_N)
    acc, _ = _expert_matmul(a, pair // ROWS_PER_A, stride_at, valid, w + e * stride_we,
                            stride_wn, stride_wk, n, n_ok, K, 0, "ieee", BLOCK_M, BLOCK_N,
                            BLOCK_K)
    tl.store(out + pair[:, None] * stride_ot + n[None, :], acc * scale,
             mask=valid[:, None] & n_ok[None, :])


def _lora_delta(rows: torch.Tensor, rows_per_row: int, factors, sorted_pairs: torch.Tensor,
                block_expert: torch.Tensor, num_pairs: int, block_m: int, block_n: int,
                block_k: int, warps: int) -> torch.Tensor:
    """fp32 [T*k, out]: each pair's s * (row A_e^T) B_e^T, its row rows[p // rows_per_row]."""
    a, b, scale = factors
    rank, out_features = a.shape[1], b.shape[1]
    rows = rows.float().contiguous()
    tile_r = min(64, max(16, triton.next_power_of_2(rank)))  # tl.dot takes 16 at least
    shrunk = torch.empty(num_pairs, rank, dtype=torch.float32, device=rows.device)
    delta = torch.empty(num_pairs, out_features, dtype=torch.float32, device=rows.device)
    num_blocks = block_expert.numel()
    for src, w, dst, per, k, n, bn, bk, s in (
            (rows, a, shrunk, rows_per_row, a.shape[2], rank, tile_r, block_k, 1.0),
            (shrunk, b, delta, 1, rank, out_features, block_n, tile_r, scale)):
        _pair_matmul_kernel[(num_blocks, triton.cdiv(n, bn))](
            src, w, dst, sorted_pairs, block_expert, num_pairs, s, src.stride(0), w.stride(0),
            w.stride(1), w.stride(2), dst.stride(0), ROWS_PER_A=per, K=k, N=n, BLOCK_M=block_m,
            BLOCK_N=bn, BLOCK_K=bk, num_warps=warps)
    return delta


def align(topk_ids: torch.Tensor, num_experts: int, block_m: int
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_pairs [max_rows], block_expert [max_rows / block_m]) for topk_ids [T, k]: pair
    p = t * k + j, sorted by expert (stably), each expert's run padded to a multiple of block_m
    with the value T*k; block_expert[b] is the expert of rows b*block_m.., -1 past the runs.
    Shapes depend on T, k, E and block_m only, and nothing is read back to the host."""
    flat = topk_ids.reshape(-1).long()
    num_pairs, dev = flat.numel(), flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    padded_start = padded_end - padded
    start = counts.cumsum(0) - counts
    order = torch.argsort(flat, stable=True)
    expert = flat[order]
    dest = padded_start[expert] + torch.arange(num_pairs, device=dev) - start[expert]
    # At most min(E, T*k) runs, each padded by fewer than block_m rows.
    max_rows = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    max_rows = triton.cdiv(max_rows, block_m) * block_m
    sorted_pairs = torch.full((max_rows,), num_pairs, dtype=torch.int32, device=dev)
    sorted_pairs[dest] = order.to(torch.int32)
    block_start = torch.arange(0, max_rows, block_m, device=dev)
    block_expert = torch.searchsorted(padded_end, block_start, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return sorted_pairs, block_expert


def _config(num_pairs: int, num_experts: int, on_gpu: bool,
            invariant: bool) -> tuple[int, int, int, int]:
    """BLOCK_M, BLOCK_N, BLOCK_K, num_warps. Small blocks of tokens when each expert gets few
    (decode), larger ones for prefill, unless `invariant` (one tile shape whatever the token
    count: a token's sums must not change with it). Untuned: no device was lent when this
    was written."""
    if not on_gpu:  # the interpreter: small tiles keep it quick
        return 16, 32, 32, 1
    block_m = 16 if invariant or num_pairs <= 32 * num_experts else 64
    return block_m, 64, 64, 4


def fused_moe(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              activation: str = "silu", lora=None, invariant: bool = False) -> torch.Tensor:
    """x [T, H]; w_gate_up [E, 2I, H]; w_down [E, H, I]; topk_weights [T, k] (fp32);
    topk_ids [T, k] (ints in [0, E)); `lora`: (gate-up's, down's) LoRA adapter (A [E, r, in],
    B [E, out, r], scale), fp32, either None; `invariant`: each token's result the same bits
    whatever the other tokens (EngineConfig.batch_invariant). Returns [T, H] in x's dtype."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"fused_moe: activation must be one of {ACTIVATIONS}, got "
                         f"{activation!r}")
    num_tokens, hidden = x.shape
    num_experts, inter = w_down.shape[0], w_down.shape[2]
    top_k = topk_ids.shape[1]
    if w_gate_up.shape != (num_experts, 2 * inter, hidden):
        raise ValueError(f"fused_moe: w_gate_up {tuple(w_gate_up.shape)} must be [E, 2I, H] = "
                         f"{(num_experts, 2 * inter, hidden)}")
    if w_down.shape != (num_experts, hidden, inter):
        raise ValueError(f"fused_moe: w_down {tuple(w_down.shape)} must be [E, H, I] = "
                         f"{(num_experts, hidden, inter)}")
    if topk_weights.shape != topk_ids.shape or topk_ids.shape[0] != num_tokens:
        raise ValueError(f"fused_moe: topk_weights {tuple(topk_weights.shape)} and topk_ids "
                         f"{tuple(topk_ids.shape)} must be one [{num_tokens}, k] shape")
    if not x.dtype == w_gate_up.dtype == w_down.dtype:
        raise ValueError(f"fused_moe: x {x.dtype}, w_gate_up {w_gate_up.dtype} and w_down "
                         f"{w_down.dtype} must be one dtype")
    if num_tokens == 0:
        return torch.zeros_like(x)
    x = x.contiguous()
    num_pairs = num_tokens * top_k
    block_m, block_n, block_k, warps = _config(num_pairs, num_experts, x.is_cuda, invariant)
    sorted_pairs, block_expert = align(topk_ids, num_experts, block_m)
    num_blocks = block_expert.numel()
    h = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    y = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    weights = topk_weights.reshape(-1).float().contiguous()
    # fp32 inputs would otherwise be rounded to tf32 on the GPU; invariant, under the
    # interpreter, summed row by row (row_invariant.row_dot).
    precision = (dot_precision(x.dtype, x.is_cuda) if invariant
                 else "ieee" if x.dtype == torch.float32 else "tf32")
    gate_up_lora, down_lora = lora or (None, None)
    tiles = (sorted_pairs, block_expert, num_pairs, block_m, block_n, block_k, warps)
    delta = None if gate_up_lora is None else _lora_delta(x, top_k, gate_up_lora, *tiles)
    _gate_up_kernel[(num_blocks, triton.cdiv(inter, block_n))](
        x, w_gate_up, h, h if delta is None else delta, sorted_pairs, block_expert, num_pairs,
        x.stride(0), w_gate_up.stride(0), w_gate_up.stride(1), w_gate_up.stride(2), h.stride(0),
        0 if delta is None else delta.stride(0), TOP_K=top_k, HIDDEN=hidden, INTER=inter,
        ACT=activation, HAS_DELTA=delta is not None, DOT_PRECISION=precision, BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps)
    delta = None if down_lora is None else _lora_delta(h, 1, down_lora, *tiles)
    _down_kernel[(num_blocks, triton.cdiv(hidden, block_n))](
        h, w_down, y, weights, y if delta is None else delta, sorted_pairs, block_expert,
        num_pairs, h.stride(0), w_down.stride(0), w_down.stride(1), w_down.stride(2),
        y.stride(0), 0 if delta is None else delta.stride(0), HIDDEN=hidden, INTER=inter,
        HAS_DELTA=delta is not None, DOT_PRECISION=precision, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=block_k, num_warps=warps)
    per_expert = y.view(num_tokens, top_k, hidden)
    if not invariant:
        return per_expert.float().sum(1).to(x.dtype)
    # The k experts' outputs added in one fixed order: torch's sum over them may split the
    # work by the token count.
    out = per_expert[:, 0].float().contiguous()  # a copy of the strided view (all_reduce: dense)
    for j in range(1, top_k):
        out += per_expert[:, j]
    return out.to(x.dtype)

