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

import torch


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    """log_softmax(x, dim=-1) in x's dtype; differentiable (the shift by the row's max is
    constant to it: the max is taken off the graph)."""
    shifted = x - x.detach().amax(dim=-1, keepdim=True)
    log_total = shifted.exp().sum(dim=-1, keepdim=True).log()
    # In place: nothing on the graph keeps `shifted` (exp's backward reads exp's output).
    return shifted.sub_(log_total)
