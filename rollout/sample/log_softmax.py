"""log_softmax over the vocabulary, summed exactly enough for the logprobs the engine reports.

torch's CPU log_softmax sums exp(x - max) along a row in float32 lanes, and over a vocabulary
of tens of thousands the sum's rounding is most of a logprob's error: on SmolLM2-135M (49,152
tokens) its greedy tokens' logprobs are 7.5e-6 from the float64 log_softmax of the same
float32 logits on average, this function's 1.1e-7 (the sum through torch's sum, a cascade of
partial sums), and x - torch.logsumexp(x), TRL's way, 5.4e-7: its float32 log-sum-exp rounds
at the logits' magnitude. Here the row is shifted by its max first (exact
near the max, where sampled tokens are), so the only roundings left are the sum's and its log's,
both at the scale of the probabilities. It costs the grpo workload ~1 % of its throughput on 2
cores (630.4 against 635.5 tok/s with torch's, best of 3, interleaved: docs/benchmarks.md)."""

from __future__ import annotations

from collections.abc import Callable

import torch


def as_batch(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """fn(x), a row-wise operation over the last dimension (a reduction that keeps it, or a
    scan), rounded for a lone row as for the same row in a batch. torch reduces a batch's rows
    one per thread, each in the same order, but on the CPU splits a lone row (a single output)
    across threads when it is long (32,768 elements or more), and on CUDA takes another
    algorithm for a tensor of one row (its scans: CUB's device scan): either rounds
    differently, and a token's logprob or top-p cut would depend on whether anything else was
    sampled with it. A lone row goes through as two rows of a broadcast view (no copy)."""
    if x.dim() == 0 or x.shape[:-1].numel() != 1:
        return fn(x)
    return fn(x.reshape(1, -1).expand(2, -1))[:1].reshape(*x.shape[:-1], -1)


def row_sum(x: torch.Tensor) -> torch.Tensor:
    """x.sum(-1, keepdim=True) in x's dtype, each row rounded as it is in any batch: on the
    CPU through as_batch; on CUDA outside autograd by the row kernel of kernels/triton/
    row_invariant.py (in every backend: the engine's logprobs go through here), since torch's
    CUDA sum splits a row across blocks when the rows are few. Under autograd, torch's sum
    (on CUDA, then, not batch-invariant)."""
    if x.is_cuda and not (x.requires_grad and torch.is_grad_enabled()):
        from rollout_kernels.triton.row_invariant import row_sum as kernel

        return kernel(x).to(x.dtype)
    return as_batch(lambda e: e.sum(dim=-1, keepdim=True), x)


def row_logsumexp(x: torch.Tensor) -> torch.Tensor:
    """torch.logsumexp(x, -1, keepdim=True), each row rounded as it is in any batch."""
    if not x.is_cuda:
        return as_batch(lambda c: torch.logsumexp(c, dim=-1, keepdim=True), x)
    top = x.amax(dim=-1, keepdim=True)
    return top + row_sum((x - top).exp()).log()


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    """log_softmax(x, dim=-1) in x's dtype; differentiable (the shift by the row's max is
    constant to it: the max is taken off the graph)."""
    shifted = x - x.detach().amax(dim=-1, keepdim=True)
    log_total = row_sum(shifted.exp()).log()
    # In place: nothing on the graph keeps `shifted` (exp's backward reads exp's output).
    return shifted.sub_(log_total)
