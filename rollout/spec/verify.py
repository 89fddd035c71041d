"""Verification: the target's k+1 logits rows decide which draft tokens survive.

Two acceptance rules, both leaving the output distributed exactly as plain sampling would:

- "coupled" (default): accept draft d while it equals the token the target itself samples at
  that position (argmax when greedy; the counter-noise Gumbel-max sample otherwise), and emit
  the target's sample at the first mismatch (or as the bonus after k matches). Every emitted
  token is the target's own sample, so speculation changes no output, only speed. For a
  deterministic proposal (n-gram, q one-hot) this accepts with probability p(d) = min(1, p/q)
  and, on rejection, emits a draw from p restricted to tokens != d, i.e. max(0, p - q)
  renormalised: the standard rule, realised through the shared noise. A draft model sampling
  with the same noise agrees with the target whenever their noisy argmaxes coincide.
- "rejection": the textbook rule for stochastic drafts (a draft model's): accept d with
  probability min(1, p(d)/q(d)) using an independent coin, on rejection sample max(0, p - q)
  renormalised. Its acceptance is optimal for a given q; outputs then depend on the drafts
  (still exact in distribution), and the drafts on scheduling (docs/speculation.md). For a
  deterministic proposal that rule is the one above, so its rows are verified coupled: the
  same acceptance, and outputs that never depend on the drafts.

p and q are the filtered (top-k/p/min-p) distributions. Coins and resampling noise come from
the counter-based streams keyed by (sample seed, position). Everything per row is computed here
in torch; the scan along each request's drafts is `accept`: the backend's (speculator.py ACCEPT),
the Triton kernel of kernels/triton/spec_accept.py or its torch reference.
"""

from __future__ import annotations

import torch

from ..sample.noise import ACCEPT_STREAM, RESIDUAL_STREAM, gumbel_noise, uniform_scalar
from ..sample.sampler import Emitted, SamplingBatch, pick, target_logprobs
from ..sample.support import sampled_at
from .accept import accept_drafts_ref


class Verdict(Emitted):
    """Emitted: the accepted drafts, then the correction or bonus token, with the target's
    logprobs, sampling logprobs and supports at each (the truncated distributions the
    acceptance ran on). What the sample keeps of it is the commit's (Speculator.after_commit)."""

    @property
    def accepted(self) -> int:
        return len(self.tokens) - 1


def draft_distributions(drafts: list[list[int]], draft_probs: list[torch.Tensor | None],
                        vocab: int, device) -> torch.Tensor:
    """q [R, V] per verify row (zeros on each request's last row, which has no draft, and on
    the rows of a deterministic proposal, which are verified coupled)."""
    return torch.cat([torch.zeros(len(draft) + 1, vocab, device=device) if probs is None
                      else torch.cat([probs.to(device), torch.zeros(1, vocab, device=device)])
                      for draft, probs in zip(drafts, draft_probs)])


def verify(logits: torch.Tensor, batch: SamplingBatch, drafts: list[list[int]],
           draft_probs: list[torch.Tensor | None], rule: str = "coupled", pick=pick,
           accept=accept_drafts_ref, want_support: tuple[bool, ...] | None = None
           ) -> list[Verdict]:
    """`logits` [R, V]: for each request its len(draft)+1 rows; `batch` holds one row per
    logits row (position = the position of the token that row predicts). `pick`: the target's
    sampler (Sampler.pick), `accept`: the acceptance scan (speculator.py ACCEPT); the torch
    references by default."""
    device, vocab = logits.device, logits.shape[-1]
    logp, candidates = target_logprobs(logits, batch)
    target = pick(logits, candidates, batch)  # the target's own sample (argmax when greedy)
    d = torch.tensor([t for draft in drafts for t in (*draft, -1)], device=device)
    row_indptr = torch.tensor([0] + [len(draft) + 1 for draft in drafts]).cumsum(0)
    rows = dict(row_indptr=row_indptr.to(device, torch.int32), target=target, draft=d,
                greedy=batch.temperature == 0)
    if rule == "rejection" and not batch.all_greedy and any(q is not None for q in draft_probs):
        # The scan's `greedy` rows take the coupled rule; so do those of a deterministic
        # proposal (n-gram, history: q one-hot), for which min(1, p/q) with resampling from
        # max(0, p - q) is what coupling realises (accept with p(d), else a draw from p without
        # d). Through the target's own noise their outputs never depend on the drafts, which
        # depend on scheduling (siblings' progress, the step's budget, pool room, the history).
        one_hot = [probs is None for draft, probs in zip(drafts, draft_probs)
                   for _ in range(len(draft) + 1)]
        rows["greedy"] = rows["greedy"] | torch.tensor(one_hot, device=device)
        q = draft_distributions(drafts, draft_probs, vocab, device)
        safe_d = d.clamp(min=0)[:, None]
        p = candidates.softmax(dim=-1)
        noise = gumbel_noise(batch.seed, batch.position, vocab, RESIDUAL_STREAM)
        rows.update(p_draft=p.gather(-1, safe_d).squeeze(-1),
                    q_draft=q.gather(-1, safe_d).squeeze(-1),
                    coin=uniform_scalar(batch.seed, batch.position, ACCEPT_STREAM),
                    residual=((p - q).clamp(min=0).log() + noise).argmax(dim=-1))
    num_accepted, last_token = accept(**rows)
    num_accepted, last_token = torch.stack([num_accepted.long(), last_token]).tolist()  # 1 sync
    verdicts, picked_rows, picked_tokens = [], [], []
    for draft, start, a, last in zip(drafts, row_indptr.tolist(), num_accepted, last_token):
        tokens = [*draft[:a], last]
        picked_rows += range(start, start + a + 1)
        picked_tokens += tokens
        verdicts.append(Verdict(tokens, [], [], []))
    lps = logp[torch.tensor(picked_rows), torch.tensor(picked_tokens)].tolist()
    sampling, supports = sampled_at(candidates, picked_rows, picked_tokens, lps, batch.greedy,
                                    batch.truncated,
                                    want_support or (False,) * len(batch.greedy))
    at = 0
    for v in verdicts:
        end = at + len(v.tokens)
        v.logprobs, v.sampling_logprobs, v.supports = lps[at:end], sampling[at:end], \
            supports[at:end]
        at = end
    return verdicts
