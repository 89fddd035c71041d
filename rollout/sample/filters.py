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

from .log_softmax import as_batch

# --- top-k / top-p / min-p ----------------------------------------------------------------
#
# The definition is `filter_by_sort`: sort the row, keep the first k (top-k), then, renormalised
# over those, the positions before the first one whose mass before it (a float32 softmax of the
# sorted row, cumsum, minus its own probability) reaches top_p (top-p), then drop what min-p
# excludes. Each cut keeps every token tied with the last one it keeps (`_cut_at`): which of
# the tied tokens an unstable sort puts first is unspecified, and the Triton sampler, which
# never sorts, keeps them all. A full sort with
# indices costs several times the rest of a sampling step on the CPU, so `filter_by_threshold`
# computes the same result from less:
#
# - The kept tokens of the top-k / top-p stage are the first r of the sorted row and those tied
#   with the r-th, for an r found below: exactly the ones with logp >= (r-th value), and with
#   min-p the row reduces to one threshold: keep logp >= max(r-th value, max + log(min_p)).
# - top-k alone: r = k; the k-th value comes from `_top_values` (no sort). min-p alone needs
#   only the max. With top-p, the top-k survivors it renormalises over are the k and the values
#   tied with the k-th.
# - top-p: the float32 probabilities depend on the softmax's float32 sum over the whole sorted
#   row, whose rounding depends on the order of every element. They are not recomputed. Instead,
#   on the top candidates (`_top_values`), the exact probabilities are bounded: every rounding the
#   reference can make (sum, exp, cumsum, the two casts) moves a mass-before by at most
#   rho * mass + 2**-20, with rho derived from the vocabulary (or k) size alone, whatever the
#   summation order. Rows where each candidate is surely kept up to one that is surely dropped
#   are decided (masses only grow down the sorted row, so every later token is dropped too).
#   With a small top-k the bound is tight (as many terms as survivors); undecided rows then
#   run the reference softmax on the exact survivors' values (the rest of the reference row is
#   -inf anyway).
#   Without top-k, only rows whose top CANDIDATES can hold top_p are worth it: the largest
#   CANDIDATES block maxima (below) are that many distinct tokens, so their mass is a lower
#   bound on the top CANDIDATES' mass.
# - The largest values (top-k, candidates) are read from a few blocks of columns, not the whole
#   row: the pass that finds each row's maximum also keeps the maxima of ~BLOCKS blocks, and
#   the k largest values lie in the k blocks with the largest maxima (`_top_values`); a topk
#   over those costs about half of one over the row.
# - Other top-p rows (flat distributions, large top-k) need the sorted values of the whole row:
#   a sort of the values only (no indices; the sorted values are unique whatever the algorithm;
#   a radix sort in C for log-probabilities) fed to the same torch softmax as the reference, so
#   their floats are the reference's bit for bit, then a scan to the first dropped position.
#   This sort is the floor of an exact top-p on a flat row: the reference's float32 sum, hence every
#   probability's last bits, depends on where each of the vocabulary's values sits. Without
#   the order that sum's rounding is only bounded by ~(vocab / 8) * 2**-24 of it (torch sums
#   in 8 float32 lanes, each sequentially), ~4e-4 at 49,152 tokens, while a token at a boundary
#   in the bulk of the row holds ~4e-5 (N(0, 9) logits): such rows all need the sort, which
#   then makes most of their cost. The sort runs on one thread and releases the GIL: the rows
#   are split over torch's number of threads.
# - Rows with a NaN (or without a finite maximum) are left to `filter_by_sort`.

_U = 2.0 ** -24  # float32 unit roundoff
TOPK_MAX = 1024  # top-k up to this many: `_top_values`; beyond, a sort of the values
CANDIDATES = 64  # top-p without a small top-k: candidates bounded before sorting the values
BLOCKS = 512  # blocks of columns whose maxima are kept with each row's maximum


def filter_by_sort(logp: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                   min_p: torch.Tensor, log_min_p: torch.Tensor | None = None) -> torch.Tensor:
    """The definition of the filters, by a full sort (also the path off the CPU).
    `log_min_p` = torch.log(min_p) computed on the whole batch, for row subsets (a vectorised
    log may round the last elements of a tensor differently)."""
    vocab = logp.shape[-1]
    sorted_logp, order = logp.sort(dim=-1, descending=True)
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab).to(torch.int64)
    drop_sorted = _cut_at(sorted_logp, k)  # top-k
    probs = sorted_logp.masked_fill(drop_sorted, float("-inf")).softmax(dim=-1)
    # (On CUDA a lone row's scan as a batch's; the CPU scans each row in order either way.)
    mass_before = (as_batch(lambda p: p.cumsum(dim=-1), probs) if probs.is_cuda
                   else probs.cumsum(dim=-1)) - probs
    # top_p == 1 means off: in fp32 the mass before the tail can round to exactly 1.0.
    drop_sorted |= (mass_before >= top_p[:, None]) & (top_p[:, None] < 1)
    drop_sorted[:, 0] = False  # the most likely token always survives
    drop_sorted = _cut_at(sorted_logp, _first_true(drop_sorted))  # top-p
    drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
    if log_min_p is None:
        log_min_p = torch.log(min_p)
    drop |= logp < (sorted_logp[:, :1] + log_min_p[:, None])
    return logp.masked_fill(drop, float("-inf"))


def _cut_at(sorted_logp: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """The sorted positions a cut after the first r (>= 1) of each row drops: those at r and
    past it, except the values tied with the last one kept, sorted_logp[r - 1]. Which of the
    tied tokens an unstable sort puts first is unspecified; keeping them all makes the kept set
    a function of the values alone, whatever the tokens' order or the sort's algorithm, as the
    Triton sampler has it (a NaN row is cut by position)."""
    ranks = torch.arange(sorted_logp.shape[-1], device=sorted_logp.device)
    last = sorted_logp.gather(-1, (r - 1)[:, None])
    return (ranks[None, :] >= r[:, None]) & (sorted_logp != last)


def _first_true(mask: torch.Tensor) -> torch.Tensor:
    """Index of the first True per row, mask.shape[-1] when none."""
    first = mask.to(torch.uint8).argmax(dim=-1)
    return torch.where(mask.any(dim=-1), first, mask.shape[-1])


def _prefix_by_bounds(vals: torch.Tensor, m: torch.Tensor, k: torch.Tensor,
                      top_p: torch.Tensor, small_k: bool, vocab: int) -> torch.Tensor:
    """Kept prefix length of top-k/top-p rows from their top values `vals` [n, K] (sorted,
    exact), or -1 where rounding could decide either way. small_k: the reference renormalises
    over each row's first k values (k <= K: the top-k survivors, ties included); otherwise
    top-k is off (k = vocab) and the probabilities are exp(logp) (logp from log_softmax.py) up
    to the rounding of both float32 sums (that of log_softmax, that of the reference's
    softmax).

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
    top-k-masked row, bit for bit; k: the top-k survivors, ties included): the first position
    > 0 whose mass before it reaches top_p or that is past k, examining positions < length;
    the whole row if none is and length is the vocabulary, else -1.

    In one pass per row that stops at that position (kernels/cpu/top_p_prefix.c, the same bits;
    rows split over the filter's threads) where the C library is built, else in torch ops
    (`_prefix_exact_ops`)."""
    if not native_prefix.supported():
        return _prefix_exact_ops(probs, k, top_p, length)
    out = torch.empty(probs.shape[0], dtype=torch.int64)

    def scan(lo: int, hi: int) -> None:
        out[lo:hi] = native_prefix.prefix_lengths(probs[lo:hi], k[lo:hi], top_p[lo:hi], length)

    _in_threads(scan, probs.shape[0])
    return out


def _prefix_exact_ops(probs: torch.Tensor, k: torch.Tensor, top_p: torch.Tensor,
                      length: int) -> torch.Tensor:
    """`_prefix_exact` in torch ops: the reference the C scan is tested against."""
    head = probs[:, :length]
    cum = head.cumsum(dim=-1)
    pos = torch.arange(length, device=probs.device)
    drop = (cum - head >= top_p[:, None]) | (pos[None, :] >= k[:, None])
    drop[:, 0] = False
    r = _first_true(drop)
    return torch.where((r < length) | (length == probs.shape[-1]), r, -1)


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
    top-p decided by bounds or none), "top_k_softmax" (top-p on the exact survivors' values),
    "candidates" (top-p decided by bounds on CANDIDATES), "sorted" (a sort of the values),
    "reference" (`filter_by_sort`: NaN, or nothing finite)."""
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
    # keep all, as for min-p alone); every value tied with it is kept too (`_cut_at`).
    v = [neg_inf] * batch
    settled = [False] * batch
    for i in ok:  # min-p alone
        settled[i] = not (ks[i] < vocab or ps[i] < 1)

    def count(path: str, n: int) -> None:
        if stats is not None:
            stats[path] = stats.get(path, 0) + n

    def settle(rows: list[int], rr: torch.Tensor, values: torch.Tensor) -> list[int]:
        """Record prefix lengths rr (>= 1, or -1: left open) of `rows`, whose top sorted values
        are `values` (at least rr of them); returns the rows left open."""
        last = values.gather(-1, (rr.clamp(min=1) - 1)[:, None]).flatten().tolist()
        for i, r, a in zip(rows, rr.tolist(), last):
            if r >= 1:
                v[i] = a if r < vocab else neg_inf
                settled[i] = True
        return [i for i in rows if not settled[i]]

    def rows_of(rows: list[int]) -> torch.Tensor:
        return torch.tensor(rows, dtype=torch.int64)

    small_k = [i for i in ok if ks[i] < vocab and ks[i] <= TOPK_MAX]
    by_sort = [i for i in ok if ks[i] > TOPK_MAX and ks[i] < vocab
               or ks[i] == vocab and ps[i] < 1]
    if small_k:
        kk = torch.tensor([ks[i] for i in small_k], dtype=torch.int64)
        with_p = [j for j, i in enumerate(small_k) if ps[i] < 1]
        width = min(vocab, max(ks[i] for i in small_k) + 1)
        vals = _top_values(logp, rows_of(small_k), maxima, width)
        if with_p:
            # top-p renormalises over the top-k survivors, the values tied with the k-th too:
            # kp of them, read with one value more (twice as many values where a tie runs past
            # those read: bf16-valued logits tie at nearly every rank).
            jp = rows_of(with_p)
            kth = vals[jp, kk[jp] - 1]
            # A k-th value of -inf (fewer finite values than k): the finite ones, all read, are
            # the survivors with any mass (-inf ones change no probability nor any output).
            floor = kth.clamp(min=torch.finfo(vals.dtype).min)
            kp = (vals[jp] >= floor[:, None]).sum(dim=-1)
            while (kp == width).any() and width < vocab:
                width = min(vocab, 2 * width)
                vals = _top_values(logp, rows_of(small_k), maxima, width)
                kp = (vals[jp] >= floor[:, None]).sum(dim=-1)
        rr = kk.clone()
        n_open = 0
        if with_p:
            pp = top_p[rows_of(small_k)[jp]]
            found = _prefix_by_bounds(vals[jp], vals[jp, 0], kp, pp, True, vocab)
            open_ = (found < 0).nonzero().flatten()
            n_open = open_.numel()
            if n_open:  # the reference softmax over the survivors' exact values (-inf after)
                x = torch.full((n_open, vocab), neg_inf, dtype=logp.dtype)
                x[:, :width] = vals[jp[open_]].masked_fill(
                    torch.arange(width)[None, :] >= kp[open_][:, None], neg_inf)
                found[open_] = _prefix_exact(x.softmax(dim=-1), kp[open_], pp[open_], width)
            rr[jp] = found
        count("top_k", len(small_k) - n_open)
        count("top_k_softmax", n_open)
        reference += settle(small_k, rr, vals)  # none: the exact scan settles every row
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
        settle(bound, rr, vals)  # what is left (undecided) goes on to the sort
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
            if any(ks[by_sort[j]] < vocab for j in with_p):  # the top-k survivors, ties too
                kp = (x >= x.gather(-1, kp[:, None] - 1)).sum(dim=-1)
                x = x.masked_fill(torch.arange(vocab)[None, :] >= kp[:, None], neg_inf)
            rr[jp] = _prefix_exact(x.softmax(dim=-1), kp, top_p[rows_of(by_sort)[jp]], vocab)
        count("sorted", len(by_sort))
        reference += settle(by_sort, rr, sv)  # none: the exact scan settles every row
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
