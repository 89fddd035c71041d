"""Varlen paged attention over the page-size-1 KV pool: one kernel for every step kind.

A step's batch is flat: request b owns query rows `qo_indptr[b]:qo_indptr[b+1]` and context
slots `kv_indices[kv_indptr[b]:kv_indptr[b+1]]` (every context token, the new ones included,
in position order; `store_kv` has already written the new K/V). Prefill, chunked prefill over a
cached prefix, decode (q_len 1) and speculative verify (q_len k+1) differ only in these lengths,
so one kernel serves them all. Causality is aligned to the end of the context: query i of a
request sees positions j <= i + kv_len - q_len.

GQA: a program owns one KV head and stacks BLOCK_Q query tokens x GROUP query heads into the
rows of one tl.dot, so each gathered K/V row is read once per KV group, not once per query head.

Split-KV (flash decoding): when a decode batch has too few (request, KV head) programs to fill
the GPU, the context is cut into `num_kv_splits` ranges handled by separate programs that write
a normalised partial output and its log-sum-exp; `merge_states` combines them.

Sliding window (`window` W, Gemma 2/3, Mistral): query i sees only j > i + kv_len - q_len - W.
Blocks before a tile's first window are skipped, blocks where the tile's rows disagree are
masked, the rest run unmasked as without a window. Soft-capping (`softcap` c, Gemma 2): scores
become c * tanh(s / c) before the mask and the softmax.

No host synchronisation: grid sizes come from tensor shapes and the caller's `max_q_len` /
`max_kv_len` (Python ints); programs past a request's real length exit at once, so a decode step
with fixed-shape metadata can be captured in a CUDA graph. The grid is B x ceil(max_q_len /
BLOCK_Q) query blocks, or, when a long chunk shares the step with many short requests,
T // BLOCK_Q + B blocks that each find their request by binary search over qo_indptr.
"""

from __future__ import annotations

import functools
import math
import os

import torch
import triton
import triton.language as tl

from .merge_states import merge_states

LOG2E = 1.4426950408889634
# Splitting the context only pays when queries are few: decode and short verify steps.
MAX_SPLIT_Q_LEN = 8
# Below this many KV positions per split, the merge costs more than the extra parallelism saves.
MIN_KV_PER_SPLIT = 256
MAX_KV_SPLITS = 64
# The batch-invariant mode sizes every tile as for queries this long: the widest tile.
INVARIANT_Q_LEN = 1 << 16
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)


@triton.jit
def _tanh(x):
    """tanh in float32 within 2 ulps, the same code compiled and interpreted (libdevice's tanh
    does not exist under the interpreter), as Cephes' tanhf: 1 - 2 / (e^2|x| + 1) cancels
    for small |x| (1.3e-5 relative at 1e-3: ~cap * eps on every score at Gemma 2's cap of
    50, where scores / cap are small), so below 0.625 the odd minimax polynomial
    x + x^3 P(x^2) (Cephes' coefficients). Saturates to +-1."""
    z = x * x
    p = (((-5.70498872745e-3 * z + 2.06390887954e-2) * z - 5.37397155531e-2) * z
         + 1.33314422036e-1) * z - 3.33332819422e-1
    a = tl.abs(x)
    t = 1.0 - 2.0 / (tl.exp2(a * (2.0 * 1.4426950408889634)) + 1.0)
    return tl.where(a < 0.625, x + x * z * p, tl.where(x < 0.0, -t, t))


@triton.jit
def _attend_block(acc, l_i, m_i, qt, k_pool, v_pool, kv_indices, kv_start, start, hi, row_limit,
                  kv_head, qk_scale, window, cap, stride_ks, stride_kh, stride_vs, stride_vh, d,
                  HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                  MASKED: tl.constexpr, CAUSAL: tl.constexpr, SLIDING: tl.constexpr,
                  SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One BLOCK_N slice of the context: scores, online-softmax update, P @ V."""
    n = start + tl.arange(0, BLOCK_N)
    if MASKED:
        # Positions past the range read slot 0, an in-bounds row of unknown content: its K
        # only feeds scores that are masked to -inf below, its V is zeroed on load, since
        # 0 * NaN from an uninitialised slot would poison the accumulator.
        slot = tl.load(kv_indices + kv_start + n, mask=n < hi, other=0)
    else:
        slot = tl.load(kv_indices + kv_start + n)
    slot = slot.to(tl.int64)
    k_ptr = k_pool + kv_head * stride_kh + slot[None, :] * stride_ks + d[:, None]
    v_ptr = v_pool + kv_head * stride_vh + slot[:, None] * stride_vs + d[None, :]
    if BLOCK_D == HEAD_DIM:
        kt = tl.load(k_ptr)
    else:
        kt = tl.load(k_ptr, mask=d[:, None] < HEAD_DIM, other=0.0)
    if MASKED:
        vt = tl.load(v_ptr, mask=(n[:, None] < hi) & (d[None, :] < HEAD_DIM), other=0.0)
    elif BLOCK_D == HEAD_DIM:
        vt = tl.load(v_ptr)
    else:
        vt = tl.load(v_ptr, mask=d[None, :] < HEAD_DIM, other=0.0)
    s = tl.dot(qt, kt, input_precision=DOT_PRECISION) * qk_scale
    if SOFTCAP:
        # qk_scale = sm_scale / c here, cap = c * log2(e): c * tanh(s / c) in the log2 domain.
        s = _tanh(s) * cap
    if MASKED:
        ok = n[None, :] < hi
        if CAUSAL:
            ok = ok & (n[None, :] <= row_limit[:, None])
        if SLIDING:
            ok = ok & (n[None, :] > row_limit[:, None] - window)
        s = tl.where(ok, s, float("-inf"))
    # m_i starts at a finite -1e30 so a row whose block is fully masked gets alpha = 1, p = 0
    # instead of exp2(-inf - -inf) = nan.
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision=DOT_PRECISION)
    return acc, l_i, m_new


# Runtime sizes are not specialised on (== 1, multiple of 16): a new batch size must not
# trigger a recompilation in the middle of serving.
@triton.jit(do_not_specialize=["kv_per_split", "split_base", "num_req", "blocks_per_req",
                               "window"])
def _paged_attention_kernel(
    q, k_pool, v_pool, out, part_out, part_lse,
    qo_indptr, kv_indptr, kv_indices,
    qk_scale, kv_per_split, split_base, num_req, blocks_per_req, window, cap,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_ks, stride_kh, stride_vs, stride_vh,
    stride_pt, stride_ph, stride_ps, stride_lt, stride_lh,
    GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr,
    SLIDING: tl.constexpr, SOFTCAP: tl.constexpr,
    WRITE_PARTIAL: tl.constexpr, VARLEN_GRID: tl.constexpr, DOT_PRECISION: tl.constexpr,
    ALIGNED: tl.constexpr, SLACK: tl.constexpr,
):
    # Programs run in reverse: under causality the later query blocks see more context, and
    # starting them first keeps the long programs from trailing at the end of the grid.
    bid = tl.num_programs(0) - 1 - tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    if VARLEN_GRID:
        # T // BLOCK_Q + SLACK x B blocks: request b owns those from qo_indptr[b] // BLOCK_Q
        # + SLACK x b on (the slack leaves room for partial blocks at each boundary), so the
        # grid follows the step's token count, not B x max_q_len. Binary search for the owner.
        lo = tl.full([], 0, tl.int32)
        hi = num_req + lo
        while hi - lo > 1:
            mid = (lo + hi) // 2
            owns = tl.load(qo_indptr + mid) // BLOCK_Q + SLACK * mid <= bid
            lo = tl.where(owns, mid, lo)
            hi = tl.where(owns, hi, mid)
        req = lo
        q_block = bid - (tl.load(qo_indptr + req) // BLOCK_Q + SLACK * req)
    else:
        # B x blocks_per_req blocks: fewer programs when the lengths are alike (decode).
        req = bid // blocks_per_req
        q_block = bid % blocks_per_req

    q_start = tl.load(qo_indptr + req)
    q_len = tl.load(qo_indptr + req + 1) - q_start
    kv_start = tl.load(kv_indptr + req)
    kv_len = tl.load(kv_indptr + req + 1) - kv_start
    shift = kv_len - q_len
    if ALIGNED:
        # Query blocks at multiples of BLOCK_Q of the tokens' positions in their sequence, so
        # a token sits in the same row of its tile however its request was chunked or cached:
        # the interpreter's tl.dot (numpy's BLAS) rounds a row by where it sits in the matrix
        # on some hosts (OpenBLAS on AVX2: every row moved changed bits).
        first_tok = q_block * BLOCK_Q - shift % BLOCK_Q
    else:
        first_tok = q_block * BLOCK_Q
    if first_tok >= q_len:
        return

    # Row r of the tile is query token first_tok + r // GROUP, query head
    # kv_head * GROUP + r % GROUP.
    r = tl.arange(0, BLOCK_M)
    tok = first_tok + r // GROUP
    head = kv_head * GROUP + r % GROUP
    row_ok = (r < BLOCK_Q * GROUP) & (tok < q_len) & (tok >= 0)
    d = tl.arange(0, BLOCK_D)
    q_row = (q_start + tok).to(tl.int64)
    qt = tl.load(q + q_row[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                 mask=row_ok[:, None] & (d[None, :] < HEAD_DIM), other=0.0)

    if CAUSAL:
        last_tok = tl.minimum(first_tok + BLOCK_Q, q_len) - 1
        hi = tl.minimum(kv_len, last_tok + shift + 1)
        # Positions below full_end are visible to every row of the tile: no mask needed there.
        full_end = first_tok + shift + 1
    else:
        hi = kv_len
        full_end = kv_len
    row_limit = tok + shift
    lo = split * kv_per_split
    hi = tl.minimum(hi, lo + kv_per_split)
    full_end = tl.minimum(full_end, hi)
    if SLIDING:
        # Keys before the tile's first row's window are seen by no row: skipped. From there
        # up to the last row's window start, some rows see a key and others do not: masked
        # blocks, which end at `edge`.
        first_seen = first_tok + shift - window + 1
        if ALIGNED:
            # Blocks at multiples of BLOCK_N, whichever row begins the tile: a row's blocks
            # then do not depend on how its request's queries were tiled or chunked (those
            # before its own window are fully masked for it, which changes none of its bits).
            first_seen = tl.maximum(first_seen, 0) // BLOCK_N * BLOCK_N
        all_seen = tl.minimum(first_tok + BLOCK_Q, q_len) - 1 + shift - window + 1
        lo = tl.maximum(lo, first_seen)
        edge = lo + (tl.maximum(all_seen - lo, 0) + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    else:
        edge = lo
    mid = edge + tl.maximum(full_end - edge, 0) // BLOCK_N * BLOCK_N

    m_i = tl.full([BLOCK_M], -1e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    if SLIDING:
        for start in range(lo, edge, BLOCK_N):
            acc, l_i, m_i = _attend_block(
                acc, l_i, m_i, qt, k_pool, v_pool, kv_indices, kv_start, start, hi, row_limit,
                kv_head, qk_scale, window, cap, stride_ks, stride_kh, stride_vs, stride_vh, d,
                HEAD_DIM, BLOCK_N, BLOCK_D, True, CAUSAL, SLIDING, SOFTCAP, DOT_PRECISION)
    for start in range(edge, mid, BLOCK_N):
        acc, l_i, m_i = _attend_block(
            acc, l_i, m_i, qt, k_pool, v_pool, kv_indices, kv_start, start, hi, row_limit,
            kv_head, qk_scale, window, cap, stride_ks, stride_kh, stride_vs, stride_vh, d,
            HEAD_DIM, BLOCK_N, BLOCK_D, False, CAUSAL, SLIDING, SOFTCAP, DOT_PRECISION)
    for start in range(mid, hi, BLOCK_N):
        acc, l_i, m_i = _attend_block(
            acc, l_i, m_i, qt, k_pool, v_pool, kv_indices, kv_start, start, hi, row_limit,
            kv_head, qk_scale, window, cap, stride_ks, stride_kh, stride_vs, stride_vh, d,
            HEAD_DIM, BLOCK_N, BLOCK_D, True, CAUSAL, SLIDING, SOFTCAP, DOT_PRECISION)

    has_keys = l_i > 0.0
    o = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    store_mask = row_ok[:, None] & (d[None, :] < HEAD_DIM)
    if WRITE_PARTIAL:
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        ps = split_base + split
        tl.store(part_out + q_row[:, None] * stride_pt + head[:, None] * stride_ph
                 + ps * stride_ps + d[None, :], o, mask=store_mask)
        tl.store(part_lse + q_row * stride_lt + head * stride_lh + ps, lse, mask=row_ok)
    else:
        tl.store(out + q_row[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                 o.to(out.dtype.element_ty), mask=store_mask)


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 8  # nominal, so the automatic choice is also exercised under the CPU interpreter


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.lru_cache(maxsize=None)
def _tile_config(group: int, max_q_len: int, head_dim: int, dtype: torch.dtype,
                 interpreting: bool) -> tuple[int, int, int, int, int]:
    """(BLOCK_Q, BLOCK_M, BLOCK_N, num_warps, num_stages) for this shape.

    As many query tokens per tile as fit in ~128 rows, so a verify step or a shared-prefix
    group reads each K/V row once; decode gets one token x GROUP heads, padded to 16 rows.
    """
    wide = dtype == torch.float32 or head_dim > 128  # fp32 tiles need twice the shared memory
    target_rows = 64 if wide else 128
    block_q = max(1, min(triton.next_power_of_2(max_q_len), target_rows // group))
    block_m = max(16, triton.next_power_of_2(block_q * group))  # tl.dot needs >= 16 rows
    block_n = 32 if wide else 64
    if interpreting:
        block_n = 16  # tiny test contexts still span several tiles: both loops get exercised
    num_warps = 8 if block_m >= 128 else 4
    return block_q, block_m, block_n, num_warps, 2


def choose_num_kv_splits(programs: int, max_q_len: int, max_kv_len: int, num_sms: int) -> int:
    """Enough splits that the grid covers every SM about twice, none shorter than
    MIN_KV_PER_SPLIT positions; 1 (no split) for prefill-sized query blocks."""
    if max_q_len > MAX_SPLIT_Q_LEN or programs <= 0:
        return 1
    want = triton.cdiv(2 * num_sms, programs)
    by_len = max_kv_len // MIN_KV_PER_SPLIT
    return max(1, min(want, by_len, MAX_KV_SPLITS))


def check_heads_contiguous(op: str, **tensors: torch.Tensor) -> None:
    """ValueError naming the first tensor whose head dimension (the last) is strided: the
    kernels read a head's values as one contiguous run."""
    for name, t in tensors.items():
        if t.stride(-1) != 1:
            raise ValueError(f"{op}: the head dimension of {name} must be contiguous (stride "
                             f"1), got stride {t.stride(-1)}")


def _check_args(q, k_pool, v_pool, out, qo_indptr, kv_indptr, kv_indices, *, max_q_len: int,
                max_kv_len: int, causal: bool, window: int | None,
                softcap: float | None) -> None:
    """ValueError for what the kernel would read or write past, leave unwritten or compute
    wrong, from the shapes alone: no device read and no allocation, so it may run on every
    layer and inside a CUDA graph's capture. The metadata's values are read only under Triton's
    CPU interpreter (`_check_rows_in_interpreter`)."""
    if k_pool.dim() != 3 or v_pool.shape != k_pool.shape:
        raise ValueError(f"paged_attention: k_pool {tuple(k_pool.shape)} and v_pool "
                         f"{tuple(v_pool.shape)} must be one [S, Hkv, D] shape")
    if q.dim() != 3:
        raise ValueError(f"paged_attention: q {tuple(q.shape)} must be [T, Hq, D]")
    if q.shape[2] != k_pool.shape[2]:
        raise ValueError(f"paged_attention: q's head size {q.shape[2]} differs from the pools' "
                         f"{k_pool.shape[2]}")
    if q.shape[1] % k_pool.shape[1]:
        raise ValueError(f"paged_attention: q's {q.shape[1]} heads are not a multiple of the "
                         f"pools' {k_pool.shape[1]} KV heads")
    if out.shape != q.shape:
        raise ValueError(f"paged_attention: out {tuple(out.shape)} must have q's shape "
                         f"{tuple(q.shape)}")
    if not q.dtype == k_pool.dtype == v_pool.dtype or q.dtype not in FLOAT_DTYPES:
        raise ValueError(f"paged_attention: q {q.dtype} and the pools {k_pool.dtype} / "
                         f"{v_pool.dtype} must be one dtype: float32, float16 or bfloat16")
    check_heads_contiguous("paged_attention", q=q, k_pool=k_pool, v_pool=v_pool, out=out)
    for name, t in (("qo_indptr", qo_indptr), ("kv_indptr", kv_indptr),
                    ("kv_indices", kv_indices)):
        if t.dtype not in INDEX_DTYPES or t.dim() != 1 or not t.is_contiguous():
            raise ValueError(f"paged_attention: {name} must hold int32 or int64 in one "
                             f"contiguous dimension, got {t.dtype} {tuple(t.shape)} with "
                             f"stride {t.stride()}")
    if kv_indptr.shape != qo_indptr.shape or not qo_indptr.numel():
        raise ValueError(f"paged_attention: kv_indptr {tuple(kv_indptr.shape)} must be as long "
                         f"as qo_indptr {tuple(qo_indptr.shape)}, B + 1 >= 1 entries")
    num_tokens, batch = q.shape[0], qo_indptr.shape[0] - 1
    # Every query row belongs to a request: rows past max_q_len are never computed.
    if num_tokens > batch * max(max_q_len, 0):
        raise ValueError(f"paged_attention: {num_tokens} query rows, past {batch} requests of "
                         f"at most max_q_len {max_q_len}")
    if window is not None and window < 1:
        raise ValueError(f"paged_attention: window must be >= 1, got {window}")
    if softcap is not None and not 0 < softcap < math.inf:
        raise ValueError(f"paged_attention: softcap must be finite and > 0, got {softcap}")
    if num_tokens and _interpreting():
        _check_rows_in_interpreter(num_tokens, k_pool.shape[0], qo_indptr, kv_indptr,
                                   kv_indices, max_q_len, max_kv_len, causal)


def _check_rows_in_interpreter(num_tokens: int, num_slots: int, qo_indptr: torch.Tensor,
                               kv_indptr: torch.Tensor, kv_indices: torch.Tensor, max_q_len: int,
                               max_kv_len: int, causal: bool) -> None:
    """The per-request bounds the kernel trusts, checked where the kernel runs on the CPU
    (Triton's interpreter), so reading the metadata waits for no device: rows past max_q_len
    would be left unwritten, a context past max_kv_len cut short by split-KV, kv_indptr past
    kv_indices and slots outside the pool read out of bounds (a crash or another process's
    memory). Compiled, they are the caller's to keep (paged_attention's contract)."""
    qo, kv = qo_indptr.long(), kv_indptr.long()
    if int(qo[0]) != 0 or int(qo[-1]) != num_tokens:
        raise ValueError(f"paged_attention: qo_indptr must run from 0 to q's {num_tokens} rows, "
                         f"got {int(qo[0])} to {int(qo[-1])}")
    q_lens, kv_lens = qo.diff(), kv.diff()
    for name, lens in (("qo_indptr", q_lens), ("kv_indptr", kv_lens)):
        if int(lens.min()) < 0:
            raise ValueError(f"paged_attention: {name} must not decrease, got {lens.tolist()} "
                             f"as lengths")
    if int(q_lens.max()) > max_q_len:
        raise ValueError(f"paged_attention: a request has {int(q_lens.max())} queries, past "
                         f"max_q_len {max_q_len}")
    if int(kv_lens.max()) > max_kv_len:
        raise ValueError(f"paged_attention: a context of {int(kv_lens.max())} tokens, past "
                         f"max_kv_len {max_kv_len}")
    if causal:
        short = int((kv_lens - q_lens).argmin())
        if kv_lens[short] < q_lens[short]:
            raise ValueError(f"paged_attention: a request has {int(q_lens[short])} queries over "
                             f"a context of {int(kv_lens[short])}: causal queries are its last "
                             f"tokens")
    start, end = int(kv[0]), int(kv[-1])
    if start < 0:
        raise ValueError(f"paged_attention: kv_indptr starts at {start}, below 0")
    if end > kv_indices.numel():
        raise ValueError(f"paged_attention: kv_indptr reaches {end}, past kv_indices' "
                         f"{kv_indices.numel()} entries")
    if end > start:
        low, high = (int(x) for x in torch.aminmax(kv_indices[start:end]))
        if low < 0:
            raise IndexError(f"paged_attention: kv_indices hold slot {low}, below 0")
        if high >= num_slots:
            raise IndexError(f"paged_attention: kv_indices hold slot {high}, past the pool's "
                             f"{num_slots} slots")


def launch_paged_attention(q, k_pool, v_pool, out, qo_indptr, kv_indptr, kv_indices, *,
                           sm_scale: float, max_q_len: int, max_kv_len: int, causal: bool,
                           num_kv_splits: int, part_out=None, part_lse=None, split_base: int = 0,
                           tile: tuple[int, int, int] | None = None, window: int | None = None,
                           softcap: float | None = None, invariant: bool = False):
    """Launch the kernel once. With `part_out`/`part_lse` ([T, Hq, S, D] / [T, Hq, S] fp32) it
    writes normalised partials into splits split_base .. split_base+num_kv_splits-1 instead of
    `out`; the caller merges. Shared with the shared-prefix path. `tile` = (BLOCK_N, num_warps,
    num_stages) overrides the heuristic (benchmark sweeps). `window`: sliding window (keys a
    query sees, itself included; None: all); `softcap`: score soft-capping (None: off).
    `invariant`: the tile's shape is the widest, whatever max_q_len, and window blocks start
    at multiples of BLOCK_N (see paged_attention, and its contract on the metadata)."""
    _check_args(q, k_pool, v_pool, out, qo_indptr, kv_indptr, kv_indices,
                          max_q_len=max_q_len, max_kv_len=max_kv_len, causal=causal,
                          window=window, softcap=softcap)
    _launch(q, k_pool, v_pool, out, qo_indptr, kv_indptr, kv_indices, sm_scale=sm_scale,
            max_q_len=max_q_len, max_kv_len=max_kv_len, causal=causal,
            num_kv_splits=num_kv_splits, part_out=part_out, part_lse=part_lse,
            split_base=split_base, tile=tile, window=window, softcap=softcap,
            invariant=invariant)


def _launch(q, k_pool, v_pool, out, qo_indptr, kv_indptr, kv_indices, *, sm_scale: float,
            max_q_len: int, max_kv_len: int, causal: bool, num_kv_splits: int, part_out=None,
            part_lse=None, split_base: int = 0, tile: tuple[int, int, int] | None = None,
            window: int | None = None, softcap: float | None = None, invariant: bool = False):
    """launch_paged_attention on checked arguments: paged_attention checks them once."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k_pool.shape[1]
    group = num_q_heads // num_kv_heads
    batch = qo_indptr.shape[0] - 1
    if num_tokens == 0:
        return
    block_q, block_m, block_n, num_warps, num_stages = _tile_config(
        group, INVARIANT_Q_LEN if invariant else max_q_len, head_dim, q.dtype, _interpreting())
    if tile is not None:
        block_n, num_warps, num_stages = tile
    if num_kv_splits > 1:
        per_split = triton.cdiv(max(max_kv_len, 1), num_kv_splits)
        kv_per_split = triton.cdiv(per_split, block_n) * block_n  # whole tiles per split
    else:
        kv_per_split = 1 << 30  # one split covers any context, even one longer than promised
    write_partial = part_out is not None
    if not write_partial:
        part_out = part_lse = out  # unused placeholders
        pstrides = (0, 0, 0, 0, 0)
    else:
        pstrides = (part_out.stride(0), part_out.stride(1), part_out.stride(2),
                    part_lse.stride(0), part_lse.stride(1))
    # Aligned query blocks start up to block_q - 1 tokens before a request's first query: one
    # block more per request.
    slack = 2 if invariant else 1
    blocks_per_req = triton.cdiv(max_q_len + (block_q - 1 if invariant else 0), block_q)
    varlen_blocks = num_tokens // block_q + slack * batch
    varlen_grid = varlen_blocks < batch * blocks_per_req
    num_blocks = varlen_blocks if varlen_grid else batch * blocks_per_req
    grid = (num_blocks, num_kv_heads, num_kv_splits)
    if softcap is not None:
        qk_scale, cap = sm_scale / softcap, softcap * LOG2E
    else:
        qk_scale, cap = sm_scale * LOG2E, 1.0
    _paged_attention_kernel[grid](
        q, k_pool, v_pool, out, part_out, part_lse,
        qo_indptr, kv_indptr, kv_indices,
        qk_scale, kv_per_split, split_base, batch, blocks_per_req,
        window if window is not None else 0, cap,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_pool.stride(0), k_pool.stride(1), v_pool.stride(0), v_pool.stride(1),
        *pstrides,
        GROUP=group, BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=block_n, HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim), CAUSAL=causal, SLIDING=window is not None,
        SOFTCAP=softcap is not None, WRITE_PARTIAL=write_partial,
        VARLEN_GRID=varlen_grid, ALIGNED=invariant, SLACK=slack,
        # fp32 inputs would otherwise be rounded to tf32 on the GPU.
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=num_warps, num_stages=num_stages,
    )


def paged_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                    out: torch.Tensor, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor,
                    kv_indices: torch.Tensor, *, sm_scale: float, max_q_len: int,
                    max_kv_len: int, causal: bool = True,
                    num_kv_splits: int | None = None, window: int | None = None,
                    softcap: float | None = None, invariant: bool = False) -> torch.Tensor:
    """Attention of q [T, Hq, D] over the paged context, written into out [T, Hq, D].

    k_pool, v_pool: [S, Hkv, D]; qo_indptr, kv_indptr: int32 [B+1]; kv_indices: int32 or int64
    slots. q heads h use KV head h // (Hq // Hkv).
    max_q_len / max_kv_len: upper bounds of the per-request lengths (Python ints, no device
    read). num_kv_splits: None chooses split-KV automatically (decode/verify batches too small
    to fill the GPU); an int forces it (1 = off).
    window: sliding window, query i of a request sees positions j with
    i + kv_len - q_len - window < j (None: no window). softcap: scores become
    softcap * tanh(scores / softcap) (None: off).
    invariant (EngineConfig.batch_invariant): a row's result independent of the rest of the
    step: no split-KV (its ranges follow the batch), one tile shape for every step (the rows
    of a tile each get their own dot products; a tile's other rows, masked or not, change
    none of a row's bits), key blocks at multiples of the tile's width for every row, sliding
    windows included.

    Shapes, dtypes, strides, window and softcap are checked (ValueError). The metadata's
    values are the caller's contract, read and checked only under Triton's CPU interpreter,
    since on a GPU that would wait for the device on every layer: qo_indptr runs from 0 to T
    without decreasing, every q_len <= max_q_len (rows past it are never written), kv_indptr
    does not decrease and ends within kv_indices, every kv_len <= max_kv_len (split-KV drops
    keys past it) and, causal, >= its q_len, and the slots it covers lie in [0, S) (others
    are read out of bounds).
    """
    _check_args(q, k_pool, v_pool, out, qo_indptr, kv_indptr, kv_indices,
                          max_q_len=max_q_len, max_kv_len=max_kv_len, causal=causal,
                          window=window, softcap=softcap)
    num_tokens, num_q_heads, head_dim = q.shape
    batch = qo_indptr.shape[0] - 1
    if invariant:
        num_kv_splits = 1
    if num_kv_splits is None:
        programs = batch * k_pool.shape[1]  # one query block per request at these q lengths
        num_kv_splits = choose_num_kv_splits(programs, max_q_len, max_kv_len, _num_sms(q.device))
    num_kv_splits = max(1, min(num_kv_splits, triton.cdiv(max(max_kv_len, 1), 16)))
    if num_kv_splits == 1:
        _launch(q, k_pool, v_pool, out, qo_indptr, kv_indptr, kv_indices, sm_scale=sm_scale,
                max_q_len=max_q_len, max_kv_len=max_kv_len, causal=causal, num_kv_splits=1,
                window=window, softcap=softcap, invariant=invariant)
        return out
    part_out = torch.empty(num_tokens, num_q_heads, num_kv_splits, head_dim,
                           dtype=torch.float32, device=q.device)
    part_lse = torch.empty(num_tokens, num_q_heads, num_kv_splits,
                           dtype=torch.float32, device=q.device)
    _launch(q, k_pool, v_pool, out, qo_indptr, kv_indptr, kv_indices, sm_scale=sm_scale,
            max_q_len=max_q_len, max_kv_len=max_kv_len, causal=causal,
            num_kv_splits=num_kv_splits, part_out=part_out, part_lse=part_lse, window=window,
            softcap=softcap)
    return merge_states(part_out, part_lse, out)


def paged_attention_ref(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                        qo_indptr: torch.Tensor, kv_indptr: torch.Tensor,
                        kv_indices: torch.Tensor, sm_scale: float,
                        causal: bool = True, window: int | None = None,
                        softcap: float | None = None,
                        dtype: torch.dtype | None = None) -> torch.Tensor:
    """Torch reference: per request, gather the context by slot, repeat KV heads, masked
    softmax in fp32, the output in q's dtype; with `dtype`, every step and the output in that
    dtype instead (float64: the exact answer; fp16/bf16: torch's rounding in a kernel's low
    dtype). Reads the metadata on the host; tests only."""
    num_q_heads = q.shape[1]
    group = num_q_heads // k_pool.shape[1]
    compute = dtype or torch.float32
    out = torch.zeros(q.shape, dtype=dtype or q.dtype, device=q.device)
    qo, kvp = qo_indptr.tolist(), kv_indptr.tolist()
    for b in range(len(qo) - 1):
        qs, qe, ks, ke = qo[b], qo[b + 1], kvp[b], kvp[b + 1]
        if qe == qs:
            continue
        slots = kv_indices[ks:ke].long()
        k = k_pool[slots].to(compute).repeat_interleave(group, dim=1)
        v = v_pool[slots].to(compute).repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[qs:qe].to(compute), k) * sm_scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        q_len, kv_len = qe - qs, ke - ks
        i = torch.arange(q_len, device=q.device)[:, None]
        j = torch.arange(kv_len, device=q.device)[None, :]
        if causal:
            scores = scores.masked_fill(j > i + kv_len - q_len, float("-inf"))
        if window is not None:
            scores = scores.masked_fill(j <= i + kv_len - q_len - window, float("-inf"))
        probs = scores.softmax(dim=-1)
        out[qs:qe] = torch.einsum("hqk,khd->qhd", probs, v).to(out.dtype)
    return out
