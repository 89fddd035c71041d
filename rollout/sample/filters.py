"""Top-k, top-p and min-p on log-probabilities: the filters' definition by a full sort, and
the same result computed on the CPU without sorting indices (see the notes below)."""

from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from rollout_kernels.cpu import radix_sort as native_sort
from rollout_kernels.cpu import top_p_prefix as native_prefix

# --- top-k / top-p / min-p ----------------------------------------------------------------
#
# The definition is `filter_by_sort`: sort the row, keep the first k, then the tokens whose
# renormalised mass before them (a float32 softmax of the sorted row, cumsum, minus the token's
# own probability) is < top_p, then drop what min-p excludes. A full sort with indices costs
# several times the rest of a sampling step on the CPU, so `filter_logprobs` computes the same
# result from less:
#
# - The kept tokens of the top-k / top-p stage are always the first r of the sorted row, for an
#   r found below. When the r-th and (r+1)-th sorted values differ, those tokens are exactly the
#   ones with logp >= (r-th value), and with min-p the row reduces to one threshold:
#   keep logp >= max(r-th value, max + log(min_p)). When they are equal (a tie straddling the
#   boundary), which tied tokens the unstable sort put first is unspecified, so the row goes
#   through `filter_by_sort` itself.
# - top-k alone: r = k; the k-th and (k+1)-th values come from `_top_values` (no sort). min-p
#   alone needs only the max.
# - top-p: the float32 probabilities depend on the softmax's float32 sum over the whole sorted
#   row, whose rounding depends on the order of every element. They are not recomputed. Instead,
#   on the top candidates (`_top_values`), the exact probabilities are bounded: every rounding the
#   reference can make (sum, exp, cumsum, the two casts) moves a mass-before by at most
#   rho * mass + 2**-20, with rho derived from the vocabulary (or k) size alone, whatever the
#   summation order. Rows where each candidate is surely kept up to one that is surely dropped
#   are decided (masses only grow down the sorted row, so every later token is dropped too).
#   With a small top-k the bound is tight (k terms); undecided rows then run the reference
#   softmax on the exact top-k values (the rest of the reference row is -inf anyway).
#   Without top-k, only rows whose top CANDIDATES can hold top_p are worth it: the largest
#   CANDIDATES block maxima (below) are that many distinct tokens, so their mass is a lower
#   bound on the top CANDIDATES' mass.
# - The largest values (top-k, candidates) are read from a few blocks of columns, not the whole
#   row: the pass that finds each row's maximum also keeps the maxima of ~BLOCKS blocks, and
#   the k largest values lie in the k blocks with the largest maxima (`_top_values`); a topk
#   over those costs about half of one over the row.
# - Other top-p rows (flat distributions, large top-k) need the sorted values of the whole row:
#   a numpy sort of the values only (no indices; the sorted values are unique whatever the
#   algorithm) fed to the same torch softmax and cumsum as the reference, so their floats are
#   the reference's bit for bit; only the first PREFIX positions are examined when the mass
#   there already passes top_p by more than rounding can undo. This sort (values only, SIMD)
#   is the floor of an exact top-p on a flat row: the reference's float32 sum, hence every
#   probability's last bits, depends on where each of the vocabulary's values sits. Without
#   the order that sum's rounding is only bounded by ~(vocab / 8) * 2**-24 of it (torch sums
#   in 8 float32 lanes, each sequentially), ~4e-4 at 49,152 tokens, while a token at a boundary
#   in the bulk of the row holds ~4e-5 (N(0, 9) logits): such rows all need the sort, which
#   then makes most of their cost. numpy's sort runs on one thread and releases the GIL: the
#   rows are split over torch's number of threads.
# - Rows with a NaN (or without a finite maximum) are left to `filter_by_sort`.

_U = 2.0 ** -24  # float32 unit roundoff
TOPK_MAX = 1024  # top-k up to this many: `_top_values`; beyond, a sort of the values
CANDIDATES = 64  # top-p without a small top-k: candidates bounded before sorting the values
BLOCKS = 512  # blocks of columns whose maxima are kept with each row's maximum
PREFIX = 4096  # top-p on sorted values: positions examined before the whole row
_DROP_SLACK = 2.0 ** -22  # see _prefix_exact


def filter_by_sort(logp: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                   min_p: torch.Tensor, log_min_p: torch.Tensor | None = None) -> torch.Tensor:
    """The definition of the filters, by a full sort (also the path off the CPU).
    `log_min_p` = torch.log(min_p) computed on the whole batch, for row subsets (a vectorised
    log may round the last elements of a tensor differently)."""
    vocab = logp.shape[-1]
    sorted_logp, order = logp.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logp.device)
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab).to(torch.int64)
    drop_sorted = ranks[None, :] >= k[:, None]
    probs = sorted_logp.masked_fill(drop_sorted, float("-inf")).softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    # top_p == 1 means off: in fp32 the mass before the tail can round to exactly 1.0.
    drop_sorted |= (mass_before >= top_p[:, None]) & (top_p[:, None] < 1)
    drop_sorted[:, 0] = False  # the most likely token always survives
    drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
    if log_min_p is None:
        log_min_p = torch.log(min_p)
    drop |= logp < (sorted_logp[:, :1] + log_min_p[:, None])
    return logp.masked_fill(drop, float("-inf"))


def _first_true(mask: torch.Tensor) -> torch.Tensor:
    """Index of the first True per row, mask.shape[-1] when none."""
    first = mask.to(torch.uint8).argmax(dim=-1)
    return torch.where(mask.any(dim=-1), first, mask.shape[-1])


def _prefix_by_bounds(vals: torch.Tensor, m: torch.Tensor, k: torch.Tensor,
                      top_p: torch.Tensor, small_k: bool, vocab: int) -> torch.Tensor:
    """Kept prefix length of top-k/top-p rows from their top values `vals` [n, K] (sorted,
    exact), or -1 where rounding could decide either way. small_k: every row has k < K and the
    reference renormalises over those k values; otherwise top-k is off (k = vocab) and the
    probabilities are exp(logp) (logp from log_softmax.py) up to the rounding of both
    float32 sums (that of log_softmax, that of the reference's softmax).

    Rounding bound (first order, generous): the reference's p_j is within a relative rho of
    the true probability (float32 sum of n terms in any order: n u; exp and the argument's
    rounding: 1e-5; division: u), and its mass before position i, cumsum - p_i (accumulated in
    float32 or float64), within rho * (M_i + P_i) + 2**-20 of the true M_i."""
    n, K = vals.shape
    pos = torch.arange(K, device=vals.device)
    in_k = pos[None, :] < k[:, None]
    if small_k:
        e = torch.exp(vals.double() - m.double()[:, None]).masked_fill_(~in_k, 0.0)
        prob = e / e.sum(dim=-1, keepdim=True)
        rho = ((2 * k + 64).double() * _U + 3e-5)[:, None]
    else:
        prob = torch.exp(vals.double())
        rho = (3 * vocab + 64) * _U + 5e-5
    before = prob.cumsum(dim=-1) - prob
    err = rho * (before + prob) + 2.0 ** -20
    p = top_p.double()[:, None]
    sure_kept = (before + err < p) & in_k
    sure_kept[:, 0] = True  # the top token always survives
    sure_dropped = (before - err >= p) | ~in_k
    r = _first_true(~sure_kept)
    decided = (r < K) & sure_dropped.gather(-1, r.clamp(max=K - 1)[:, None]).squeeze(-1)
    return torch.where(decided, r, -1)


def _prefix_exact(probs: torch.Tensor, k: torch.Tensor, top_p: torch.Tensor,
                  length: int) -> torch.Tensor:
    """Kept prefix length of top-p rows from the reference's own `probs` (softmax of the sorted,
    top-k-masked row, bit for bit), examining positions < length; -1 if that does not settle
    it (or the kept positions are not a prefix, which float rounding could in principle cause).

    Past `length`, every position is dropped when position length-1 is past top-k or its cumsum
    C reaches top_p + 2**-22: for i > b, C_i - p_i >= A_{i-1} - 2 * 2**-24 >= C_b - 3 * 2**-24
    (A: the cumsum accumulator, float32 or float64, nondecreasing; each cast and addition of
    values < 2 rounds by at most 2**-24) > top_p, so the float32 difference is >= top_p.

    In one fused pass per row (kernels/cpu/top_p_prefix.c, the same bits; rows split over the
    filter's threads) where the C library is built, else in torch ops (`_prefix_exact_ops`)."""
    if not native_prefix.supported():
        return _prefix_exact_ops(probs, k, top_p, length)
    out = torch.empty(probs.shape[0], dtype=torch.int64)

    def scan(lo: int, hi: int) -> None:
        out[lo:hi] = native_prefix.prefix_lengths(probs[lo:hi], k[lo:hi], top_p[lo:hi],
                                                  length, _DROP_SLACK)

    _in_threads(scan, probs.shape[0])
    return out


def _prefix_exact_ops(probs: torch.Tensor, k: torch.Tensor, top_p: torch.Tensor,
                      length: int) -> torch.Tensor:
    """`_prefix_exact` in torch ops: the reference the C scan is tested against."""
    vocab = probs.shape[-1]
    head = probs[:, :length]
    cum = head.cumsum(dim=-1)
    pos = torch.arange(length, device=probs.device)
    drop = (cum - head >= top_p[:, None]) | (pos[None, :] >= k[:, None])
    drop[:, 0] = False
    r = _first_true(drop)
    prefix = drop.sum(dim=-1) == length - r
    rest_dropped = (k <= length) | (cum[:, -1].double() >= top_p.double() + _DROP_SLACK)
    if length == vocab:
        rest_dropped = torch.ones_like(prefix)
    return torch.where(prefix & rest_dropped, r, -1)


def _take(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """x[rows] (rows sorted ascending), without a copy when rows are all of them."""
    return x if rows.numel() == x.shape[0] else x[rows]


_pool: tuple[int, ThreadPoolExecutor] | None = None  # (the pid it was made in, the pool)


def _in_threads(fn, rows: int) -> None:
    """fn(lo, hi) over row ranges covering `rows`, one per torch thread, the first in this
    one (fn is meant to release the GIL)."""
    global _pool
    parts = max(1, min(torch.get_num_threads(), rows))
    edges = np.linspace(0, rows, parts + 1).astype(int).tolist()
    if parts > 1 and (_pool is None or _pool[0] != os.getpid()):  # a forked child: a new one
        _pool = os.getpid(), ThreadPoolExecutor(os.cpu_count(), thread_name_prefix="top_p")
    others = [_pool[1].submit(fn, lo, hi) for lo, hi in zip(edges[1:-1], edges[2:])]
    fn(edges[0], edges[1])
    for job in others:
        job.result()  # wait, and raise what failed


def _sorted_values(logp: torch.Tensor, rows: torch.Tensor, nonpositive: bool) -> torch.Tensor:
    """The rows' values sorted in descending order (the values logp.sort(descending=True)
    gives), by a sort of the values alone. nonpositive: every value is <= 0 or -0.0
    (log-probabilities), whose bit patterns as uint32 sort ascending exactly as the floats sort
    descending (+0.0 first, -inf last), which spares a reversal and lets the C radix sort take
    them; else numpy's sort of the floats."""
    a = logp.detach().numpy()
    index = rows.numpy() if rows.numel() != a.shape[0] else None
    out = np.empty((rows.numel(), a.shape[1]), dtype=np.float32)
    keys = out.view(np.uint32) if nonpositive else out
    radix = nonpositive and native_sort.supported()

    def copy_and_sort(lo: int, hi: int) -> None:
        out[lo:hi] = a[lo:hi] if index is None else a[index[lo:hi]]
        if radix:  # the same order, several times faster (kernels/cpu/radix_sort.c)
            native_sort.sort_rows(torch.from_numpy(out[lo:hi].view(np.int32)))
        else:
            keys[lo:hi].sort(axis=-1)

    _in_threads(copy_and_sort, rows.numel())
    return torch.from_numpy(out) if nonpositive else torch.from_numpy(out).flip(-1)


def _block_width(vocab: int) -> int:
    """Columns per block: a row holds vocab // width >= min(BLOCKS, vocab) whole blocks."""
    return max(1, vocab // BLOCKS)


def _row_maxima(logp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(max, block maxima): each row's maximum (NaN if it holds one), and the maxima of its
    whole blocks of `_block_width` columns, [n, blocks] (the remainder, fewer columns than a
    block, is in none), in one pass."""
    width = _block_width(logp.shape[-1])
    maxima = logp.unfold(-1, width, width).amax(dim=-1)
    m = maxima.amax(dim=-1)
    rest = maxima.shape[-1] * width
    if rest < logp.shape[-1]:
        m = torch.maximum(m, logp[:, rest:].amax(dim=-1))
    return m, maxima


def _top_values(logp: torch.Tensor, rows: torch.Tensor, maxima: torch.Tensor,
                k: int) -> torch.Tensor:
    """logp[rows].topk(k).values, from `_row_maxima`'s block maxima when k is small next to
    the number of blocks: the k largest values of the k blocks with the largest maxima and of
    the remainder columns. They are the row's: with t the k-th largest block maximum, every
    value above t lies in a block whose maximum is above t (all chosen) or in the remainder,
    and the chosen maxima are k values >= t, so the k largest are those above t, then t."""
    n, blocks = rows.numel(), maxima.shape[-1]
    if 4 * k > blocks:  # the blocks would hold most of the row
        return _take(logp, rows).topk(k, dim=-1).values
    width = _block_width(logp.shape[-1])
    chosen = maxima[rows].topk(k, dim=-1).indices
    pool = logp.unfold(-1, width, width)[rows[:, None], chosen].reshape(n, k * width)
    if blocks * width < logp.shape[-1]:
        pool = torch.cat([pool, logp[rows, blocks * width:]], dim=-1)
    return pool.topk(k, dim=-1).values


def filter_by_threshold(logp: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                     min_p: torch.Tensor, normalized: bool = False, copy: bool = True,
                     stats: dict[str, int] | None = None) -> torch.Tensor:
    """`filter_by_sort`'s result on the CPU without sorting indices (see the notes above).
    normalized: `logp` is torch's log_softmax of something, as `_prefix_by_bounds` assumes
    when top-k is off (otherwise those top-p rows go to the sort of the values).
    `stats`, if given, counts the rows by the way they were settled: "top_k" (torch.topk,
    top-p decided by bounds or none), "top_k_softmax" (top-p on the exact top-k values),
    "candidates" (top-p decided by bounds on CANDIDATES), "sorted" (numpy sort of the values),
    "sorted_whole" (of which past PREFIX), "reference" (`filter_by_sort`: ties, NaN)."""
    batch, vocab = logp.shape
    neg_inf = float("-inf")
    # Rows are sorted into classes on the host (a few rows: fewer tiny tensor ops).
    ks = [min(k, vocab) if k > 0 else vocab for k in top_k.tolist()]
    ps, mps = top_p.tolist(), min_p.tolist()
    active = [i for i in range(batch) if ks[i] < vocab or ps[i] < 1 or mps[i] > 0]
    if not active:
        return logp.clone() if copy else logp
    m, maxima = _row_maxima(logp)  # m = the first sorted value; NaN if the row has one
    ms = m.tolist()
    # NaN, or nothing finite (or +inf) to rank: the reference.
    reference = [i for i in active if not math.isfinite(ms[i])]
    ok = [i for i in active if math.isfinite(ms[i])]
    # Per row: the r-th sorted value, r the kept prefix length of the top-k/top-p stage (-inf:
    # keep all, as for min-p alone), unless the (r+1)-th value ties with it.
    v = [neg_inf] * batch
    settled = [False] * batch
    for i in ok:  # min-p alone
        settled[i] = not (ks[i] < vocab or ps[i] < 1)

    def count(path: str, n: int) -> None:
        if stats is not None:
            stats[path] = stats.get(path, 0) + n

    def settle(rows: list[int], rr: torch.Tensor, values: torch.Tensor) -> list[int]:
        """Record prefix lengths rr of `rows`, whose top sorted values are `values` (at least
        rr + 1 of them unless rr = vocab); returns the rows left: rr < 1, or a tie."""
        width = values.shape[-1]
        at = rr.clamp(min=1)[:, None]
        last = values.gather(-1, at - 1).flatten().tolist()
        after = values.gather(-1, at.clamp(max=width - 1)).flatten().tolist()
        left = []
        for i, r, a, b in zip(rows, rr.tolist(), last, after):
            if r < 1 or (r < vocab and b == a and a > neg_inf):
                left.append(i)
            else:
                v[i] = a if r < vocab else neg_inf
                settled[i] = True
        return left

    def rows_of(rows: list[int]) -> torch.Tensor:
        return torch.tensor(rows, dtype=torch.int64)

    small_k = [i for i in ok if ks[i] < vocab and ks[i] <= TOPK_MAX]
    by_sort = [i for i in ok if ks[i] > TOPK_MAX and ks[i] < vocab
               or ks[i] == vocab and ps[i] < 1]
    if small_k:
        width = min(vocab, max(ks[i] for i in small_k) + 1)
        vals = _top_values(logp, rows_of(small_k), maxima, width)
        kk = torch.tensor([ks[i] for i in small_k], dtype=torch.int64)
        rr = kk.clone()
        with_p = [j for j, i in enumerate(small_k) if ps[i] < 1]
        n_open = 0
        if with_p:
            jp = rows_of(with_p)
            pp = top_p[rows_of(small_k)[jp]]
            found = _prefix_by_bounds(vals[jp], vals[jp, 0], kk[jp], pp, True, vocab)
            open_ = (found < 0).nonzero().flatten()
            n_open = open_.numel()
            if n_open:  # the reference softmax over the exact top-k values (-inf after them)
                x = torch.full((n_open, vocab), neg_inf, dtype=logp.dtype)
                x[:, :width] = vals[jp[open_]].masked_fill(
                    torch.arange(width)[None, :] >= kk[jp[open_]][:, None], neg_inf)
                found[open_] = _prefix_exact(x.softmax(dim=-1), kk[jp[open_]], pp[open_],
                                             width)
            rr[jp] = found
        count("top_k", len(small_k) - n_open)
        count("top_k_softmax", n_open)
        reference += settle(small_k, rr, vals)
    # Candidates for top-p rows without top-k where the `cand` largest block maxima (distinct
    # tokens) already hold top_p: the top `cand` tokens hold at least as much, and the boundary
    # is likely decided among them. Elsewhere they would only delay the sort.
    cand = min(CANDIDATES, vocab)
    bound = [i for i in by_sort if normalized and ks[i] == vocab]
    if bound:
        head = maxima[rows_of(bound)].topk(cand, dim=-1).values
        head_mass = torch.exp(head.double()).sum(dim=-1).tolist()
        bound = [i for i, mass in zip(bound, head_mass) if mass >= ps[i]]
    if bound:
        vals = _top_values(logp, rows_of(bound), maxima, cand)
        rr = _prefix_by_bounds(vals, vals[:, 0], torch.full((len(bound),), vocab),
                               top_p[rows_of(bound)], False, vocab)
        settle(bound, rr, vals)  # what is left (undecided, or a tie) goes on to the sort
        count("candidates", sum(settled[i] for i in bound))
        by_sort = [i for i in by_sort if not settled[i]]
    if by_sort:
        sv = _sorted_values(logp, rows_of(by_sort), all(ms[i] <= 0 for i in by_sort))
        kk = torch.tensor([ks[i] for i in by_sort], dtype=torch.int64)
        rr = kk.clone()
        with_p = [j for j, i in enumerate(by_sort) if ps[i] < 1]
        if with_p:
            jp = rows_of(with_p)
            x, kp = _take(sv, jp), kk[jp]
            if any(ks[by_sort[j]] < vocab for j in with_p):
                x = x.masked_fill(torch.arange(vocab)[None, :] >= kp[:, None], neg_inf)
            probs = x.softmax(dim=-1)
            pp = top_p[rows_of(by_sort)[jp]]
            # The first PREFIX positions first, unless even PREFIX tokens of the top token's
            # probability cannot reach top_p (a flat row: its boundary lies further).
            short = [j for j, i in enumerate(by_sort[j] for j in with_p)
                     if ks[i] <= PREFIX or math.exp(ms[i]) * PREFIX * 1.01 >= ps[i]]
            found = torch.full((len(with_p),), -1, dtype=torch.int64)
            if short and PREFIX < vocab:
                js = rows_of(short)
                found[js] = _prefix_exact(_take(probs, js), kp[js], pp[js], PREFIX)
            again = (found < 0).nonzero().flatten()
            if again.numel():
                found[again] = _prefix_exact(_take(probs, again), kp[again], pp[again], vocab)
                count("sorted_whole", again.numel())
            rr[jp] = found
        count("sorted", len(by_sort))
        reference += settle(by_sort, rr, sv)
    count("reference", len(reference))
    # log(min_p) of the whole batch, as `filter_by_sort` computes it (a vectorised log may
    # round the last elements of a tensor differently).
    log_min_p = torch.log(min_p)
    # One threshold per settled row; fmax: a NaN min-p threshold (min_p < 0) drops nothing.
    thr = torch.fmax(torch.tensor(v, dtype=logp.dtype), m + log_min_p)
    thr = torch.where(torch.tensor(settled), thr, neg_inf)
    out = torch.where(logp < thr[:, None], neg_inf, logp)
    if reference:
        rows = rows_of(sorted(reference))
        out[rows] = filter_by_sort(logp[rows], top_k[rows], top_p[rows], min_p[rows],
                                   log_min_p[rows])
    return out


def filter_logprobs(logp: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                    min_p: torch.Tensor) -> torch.Tensor:
    """Mask (-inf) the tokens that top-k, then top-p (on the top-k survivors, renormalised),
    then min-p (relative to the most likely token) exclude. `logp` is log_softmax(logits / T).
    The result is `filter_by_sort`'s bit for bit; on the CPU it is computed without a sort
    of the indices (see the notes above)."""
    if logp.device.type != "cpu" or logp.dim() != 2 or logp.dtype != torch.float32:
        return filter_by_sort(logp, top_k, top_p, min_p)
    return filter_by_threshold(logp, top_k, top_p, min_p)
