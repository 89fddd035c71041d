"""The k largest log-probabilities of each row in one defined order: value descending, equal
values by ascending token id. What top-k alternatives (rollout/sample/top.py) and scoring's
(rollout/score/rows.py) report.

torch.topk leaves tied values in an order of its own, which changes with k: where ranks 5 and
6 tie (bf16 logits, often), topk(20)[:5] and topk(5) name different tokens, so a request's
alternatives would follow the largest k asked by anything else in its step. With ties broken
by the id, a row's first j alternatives are the same whatever k >= j the step computes."""

from __future__ import annotations

import torch


def top_ranked(logp: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids int64 [R, k], values [R, k]) of `logp` [R, V]. A row holding NaN keeps topk's own
    order (its request fails on its non-finite logprobs anyway)."""
    vocab = logp.shape[-1]
    top = logp.topk(min(k + 1, vocab), dim=-1)  # one more: is the k-th tied past the k?
    ids, values = top.indices[:, :k], top.values[:, :k]
    if k == 0 or logp.shape[0] == 0:
        return ids, values
    nan = values[:, 0].isnan()  # topk ranks NaN first
    if k < vocab:  # rows whose k-th value ties with tokens past the k: the lowest ids of those
        rows = ((top.values[:, k] == values[:, k - 1]) & ~nan).nonzero().flatten()
        if rows.numel():
            ids = ids.clone()
            kth = values[rows, k - 1:k]
            wide = logp[rows].topk(min(vocab, 2 * k + 8), dim=-1)
            ids[rows] = _lowest_ids(wide.values, wide.indices, kth, k, vocab)
            whole = (wide.values[:, -1] == kth[:, 0]).nonzero().flatten()
            if whole.numel():  # the tie runs past those too: the whole rows
                at = rows[whole]
                every = torch.arange(vocab, device=logp.device).expand(len(at), vocab)
                ids[at] = _lowest_ids(logp[at], every, kth[whole], k, vocab)
    # Value descending, equal values by ascending id: a stable sort by value of the ids sorted.
    ids = ids.sort(dim=-1).values
    values = logp.gather(-1, ids)
    order = values.sort(dim=-1, descending=True, stable=True).indices
    ids, values = ids.gather(-1, order), values.gather(-1, order)
    if bool(nan.any()):
        ids[nan], values[nan] = top.indices[nan, :k], top.values[nan, :k]
    return ids, values


def _lowest_ids(values: torch.Tensor, ids: torch.Tensor, kth: torch.Tensor, k: int,
                vocab: int) -> torch.Tensor:
    """The k ids among candidates (`values`, `ids` [n, m], holding every token >= kth [n, 1]):
    those above kth, then the lowest of those equal to it (unordered otherwise)."""
    key = torch.where(values > kth, ids - vocab, torch.where(values == kth, ids, 2 * vocab))
    first = key.sort(dim=-1).values[:, :k]
    return torch.where(first < 0, first + vocab, first)
