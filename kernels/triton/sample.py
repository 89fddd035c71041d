"""Triton sampler: the same tokens and logprobs as `rollout.sampler.sample`, without a sort.

One program per row streams the vocabulary in BLOCK_V chunks, several times:
  1. max of y = logits / T (T = 1 for greedy rows) and its first argmax (the greedy token);
  2. s = sum exp(y - max); logp = (y - max) - log(s), evaluated exactly like torch's
     log_softmax so that the per-token values agree (up to the order of the sum);
  3. top-k (only if on): the k-th largest logp, found exactly by a radix-16 search over the
     order-preserving int32 key of the float (8 passes, each counting 16 thresholds at once);
  4. top-p (only if on): the smallest key t whose probability mass strictly above it, among the
     top-k survivors renormalised, is < top_p. Tokens with key >= t are exactly those whose
     mass before them in descending order is < top_p. Another radix-16 search over sums;
  5. min-p, then argmax of (filtered logp + Gumbel noise), the noise from `counter_noise`.

Exact ties at a top-k or top-p boundary keep every tied token, and top_p = 1 is off, as in the
torch filter's definition (rollout/sample/filters.py). Divergences from the torch sampler, none
of which random-logit tests can hit:
  - Sums run in a different order than torch's, so logprobs agree to ~1 ulp of log(s), and a
    top-p decision can flip when a token's mass-before lies within rounding of top_p.
  - Under the CPU interpreter, numpy's log/exp may differ from torch's CPU ones by an ulp.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .counter_noise import (
    bits_to_uniform,
    gumbel,
    precise_exp,
    precise_log,
    row_key,
    token_bits,
    use_libdevice,
)

RADIX = 16


@triton.jit
def _order_key(x):
    """float32 -> int32 whose signed order is the float order (-0.0 sorts just below +0.0)."""
    b = x.to(tl.int32, bitcast=True)
    return tl.where(b >= 0, b, b ^ 0x7FFFFFFF)


@triton.jit
def _logp_chunk(row_ptr, cols, vocab_size, temp, row_max, log_sum):
    x = tl.load(row_ptr + cols, mask=cols < vocab_size, other=float("-inf")).to(tl.float32)
    # IEEE division, as torch's `logits / temperature`; Triton's `/` may be approximate.
    return (tl.math.div_rn(x, temp) - row_max) - log_sum


@triton.jit
def _kth_largest_key(row_ptr, vocab_size, temp, row_max, log_sum, k, key_max,
                     BLOCK_V: tl.constexpr, RADIX: tl.constexpr):
    """Largest t with count(key >= t) >= k; it is the key of the k-th largest logp."""
    lo = tl.full([], -2147483648, tl.int64)  # count(key >= lo) = vocab >= k
    hi = key_max.to(tl.int64)  # count(key >= hi + 1) = 0 < k
    j = tl.arange(0, RADIX).to(tl.int64)
    while lo < hi:
        step = (hi - lo + RADIX) // RADIX
        thr = (lo + j * step).to(tl.int32)  # never past key(+inf) + 15: fits in int32
        counts = tl.zeros([RADIX], tl.int32)
        for start in range(0, vocab_size, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            key = _order_key(_logp_chunk(row_ptr, cols, vocab_size, temp, row_max, log_sum))
            hit = (key[None, :] >= thr[:, None]) & (cols[None, :] < vocab_size)
            counts += tl.sum(hit.to(tl.int32), 1)
        n_ok = tl.sum((counts >= k).to(tl.int64), 0)  # thresholds are increasing: a prefix
        new_lo = lo + (n_ok - 1) * step
        hi = tl.minimum(hi, lo + n_ok * step - 1)
        lo = new_lo
    return lo.to(tl.int32)


@triton.jit
def _top_p_key(row_ptr, vocab_size, temp, row_max, log_sum, lp_max, keep_key, total, top_p,
               key_max, BLOCK_V: tl.constexpr, RADIX: tl.constexpr,
               USE_LIBDEVICE: tl.constexpr):
    """Smallest t >= keep_key whose mass strictly above it (survivors of key >= keep_key,
    probabilities exp(logp - lp_max) / total) is < top_p."""
    lo = keep_key.to(tl.int64)
    hi = key_max.to(tl.int64)  # mass above the top token is 0 < top_p
    j = tl.arange(0, RADIX).to(tl.int64)
    while lo < hi:
        step = (hi - lo + RADIX) // RADIX
        thr = (lo + j * step).to(tl.int32)
        mass = tl.zeros([RADIX], tl.float32)
        for start in range(0, vocab_size, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            lp = _logp_chunk(row_ptr, cols, vocab_size, temp, row_max, log_sum)
            key = _order_key(lp)
            prob = tl.where(key >= keep_key, precise_exp(lp - lp_max, USE_LIBDEVICE) / total, 0.0)
            above = key[None, :] > thr[:, None]
            mass += tl.sum(tl.where(above, prob[None, :], 0.0), 1)
        n_fail = tl.sum((mass >= top_p).to(tl.int64), 0)  # a prefix of the thresholds
        # t* lies in (thr[n_fail - 1], thr[n_fail]]; with no failure it is lo itself.
        new_lo = tl.where(n_fail == 0, lo, lo + (n_fail - 1) * step + 1)
        hi = tl.where(n_fail == 0, lo, tl.minimum(hi, lo + n_fail * step))
        lo = new_lo
    return lo.to(tl.int32)


@triton.jit
def _running_argmax(values, cols, vocab_size, best, best_idx):
    """Fold one chunk into a running (max, first index of max), as torch.argmax breaks ties."""
    c_max = tl.max(values, 0)
    c_idx = tl.min(tl.where(values == c_max, cols, vocab_size), 0)
    take = c_max > best
    return tl.where(take, c_max, best), tl.where(take, c_idx, best_idx)


@triton.jit
def _sample_kernel(logits, stride_row, temperature, top_k, top_p, min_p, seed, position,
                   out_tokens, out_logprobs, vocab_size,
                   BLOCK_V: tl.constexpr, RADIX: tl.constexpr, USE_LIBDEVICE: tl.constexpr):
    row = tl.program_id(0)
    row_ptr = logits + row.to(tl.int64) * stride_row
    temp = tl.load(temperature + row)
    sampled = temp != 0.0
    temp = tl.where(sampled, temp, 1.0)

    # Pass 1: row max of y = x / T and its first argmax (torch.argmax keeps the first too).
    best = tl.full([], float("-inf"), tl.float32)
    best_idx = tl.full([], 0, tl.int32)
    for start in range(0, vocab_size, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        x = tl.load(row_ptr + cols, mask=cols < vocab_size, other=float("-inf")).to(tl.float32)
        y = tl.math.div_rn(x, temp)
        best, best_idx = _running_argmax(y, cols, vocab_size, best, best_idx)
    row_max = best

    # Pass 2: the log-sum, as torch's log_softmax: max first, then sum exp(y - max).
    acc = tl.zeros([BLOCK_V], tl.float32)
    for start in range(0, vocab_size, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        x = tl.load(row_ptr + cols, mask=cols < vocab_size, other=float("-inf")).to(tl.float32)
        acc += precise_exp(tl.math.div_rn(x, temp) - row_max, USE_LIBDEVICE)
    log_sum = precise_log(tl.sum(acc, 0), USE_LIBDEVICE)
    lp_max = (row_max - row_max) - log_sum  # the top token's logp, computed as torch does

    token = best_idx
    if sampled:
        k = tl.load(top_k + row)
        p = tl.load(top_p + row)
        mp = tl.load(min_p + row)
        key_max = _order_key(lp_max)
        keep_key = tl.full([], -2147483648, tl.int32)
        if (k > 0) & (k < vocab_size):
            keep_key = _kth_largest_key(row_ptr, vocab_size, temp, row_max, log_sum, k, key_max,
                                        BLOCK_V, RADIX)
        if p < 1.0:
            # Renormalise over the top-k survivors: torch's softmax of the masked sorted logp.
            tot = tl.zeros([BLOCK_V], tl.float32)
            for start in range(0, vocab_size, BLOCK_V):
                cols = start + tl.arange(0, BLOCK_V)
                lp = _logp_chunk(row_ptr, cols, vocab_size, temp, row_max, log_sum)
                tot += tl.where(_order_key(lp) >= keep_key,
                                precise_exp(lp - lp_max, USE_LIBDEVICE), 0.0)
            keep_key = _top_p_key(row_ptr, vocab_size, temp, row_max, log_sum, lp_max, keep_key,
                                  tl.sum(tot, 0), p, key_max, BLOCK_V, RADIX, USE_LIBDEVICE)
        keep_key = tl.minimum(keep_key, key_max)  # the most likely token always survives
        # min-p: keep logp >= lp_max + log(min_p); min_p = 0 is off (log would give -inf).
        safe_mp = tl.where(mp > 0.0, mp, 1.0)
        min_lp = tl.where(mp > 0.0, lp_max + precise_log(safe_mp, USE_LIBDEVICE), float("-inf"))

        key = row_key(tl.load(seed + row), tl.load(position + row))
        best = tl.full([], float("-inf"), tl.float32)
        best_idx = tl.full([], 0, tl.int32)
        for start in range(0, vocab_size, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            lp = _logp_chunk(row_ptr, cols, vocab_size, temp, row_max, log_sum)
            keep = (_order_key(lp) >= keep_key) & (lp >= min_lp) & (cols < vocab_size)
            u = bits_to_uniform(token_bits(key, cols))
            score = tl.where(keep, lp, float("-inf")) + gumbel(u, USE_LIBDEVICE)
            best, best_idx = _running_argmax(score, cols, vocab_size, best, best_idx)
        token = best_idx

    # The logprob is unfiltered: recompute the chosen token's logp with the same formula.
    x_tok = tl.load(row_ptr + token).to(tl.float32)
    tl.store(out_tokens + row, token.to(tl.int64))
    tl.store(out_logprobs + row, (tl.math.div_rn(x_tok, temp) - row_max) - log_sum)


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
           top_p: torch.Tensor, min_p: torch.Tensor, seed: torch.Tensor, position: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] (any float dtype; computed in fp32); temperature f32 [B] (0 = greedy);
    top_k i32 [B] (<= 0 off); top_p f32 [B] (1 off); min_p f32 [B] (0 off); seed i32 [B];
    position i32 [B]. Returns (tokens int64 [B], logprobs f32 [B]) as `rollout.sampler.sample`.
    """
    if logits.dim() != 2:
        raise ValueError(f"sample: logits {tuple(logits.shape)} must be [B, V]")
    batch, vocab_size = logits.shape
    if vocab_size == 0 and batch:
        raise ValueError(f"sample: logits {tuple(logits.shape)} have an empty vocabulary")
    # In the kernel's argument order and dtypes.
    rows = {"temperature": temperature.to(torch.float32), "top_k": top_k.to(torch.int32),
            "top_p": top_p.to(torch.float32), "min_p": min_p.to(torch.float32),
            "seed": seed.to(torch.int32), "position": position.to(torch.int32)}
    for name, t in rows.items():
        if t.shape != (batch,):
            raise ValueError(f"sample: {name} {tuple(t.shape)} must be ({batch},): one per row "
                             f"of logits")
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    device = logits.device
    tokens = torch.empty(batch, dtype=torch.int64, device=device)
    logprobs = torch.empty(batch, dtype=torch.float32, device=device)
    if batch == 0:
        return tokens, logprobs
    # The kernel reads row b's parameters at offset b: a strided view is copied.
    _sample_kernel[(batch,)](
        logits, logits.stride(0),
        *(t.contiguous() for t in rows.values()),
        tokens, logprobs, vocab_size,
        BLOCK_V=1024, RADIX=RADIX, USE_LIBDEVICE=use_libdevice(device),
        num_warps=8,
        # No a*b+c contraction anywhere: every rounding step stays the one torch performs.
        enable_fp_fusion=False,
    )
    return tokens, logprobs
