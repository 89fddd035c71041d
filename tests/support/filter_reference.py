"""The sampling filters' definition token by token, in float64 (rollout/sample/filters.py has
it by a sort): what the sampler tests hold every path's kept set and distribution to, on rows
whose decisions lie far from float32 rounding."""

from __future__ import annotations

import numpy as np
import torch


def reference(logits, temperature, top_k, top_p, min_p) -> tuple[set, np.ndarray]:
    """The kept set and the renormalised float64 distribution over the vocabulary of one row
    (`logits`: a tensor or array): softmax(logits / T), keep the k most likely (and every token
    tied with the k-th), then those whose mass strictly above them (renormalised over the top-k
    survivors) is < top_p (the most likely always), then drop those below min_p times the most
    likely."""
    z = torch.as_tensor(logits).double().numpy() / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    k = top_k if 0 < top_k < len(p) else len(p)
    head = np.nonzero(p >= np.sort(p)[::-1][k - 1])[0]
    q = p[head] / p[head].sum()
    above = np.array([q[q > x].sum() for x in q])
    kept = {int(t) for t, a in zip(head, above) if a < top_p or top_p >= 1 or a == 0}
    kept = {t for t in kept if p[t] >= min_p * p.max()}
    dist = np.zeros_like(p)
    idx = sorted(kept)
    dist[idx] = p[idx] / p[idx].sum()
    return kept, dist
