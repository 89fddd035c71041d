"""The trainer's side of the importance ratio: log_softmax(logits / T) of each target token,
the same quantity the engine returned when it sampled (see rollout/sample/sampler.py), or the
same renormalised over the tokens the sampler kept (`keep`: the batch's supports, what
rollout.logprobs_on_support computes for one sample)."""

from __future__ import annotations

import torch


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, temperature: float,
                   keep: torch.Tensor | None = None) -> torch.Tensor:
    """[N, L, V] logits of a forward over input_ids -> [N, L-1] logprob of each next token;
    with `keep` (bool [N, L-1, V]) renormalised over the kept tokens of each position.

    Gather minus logsumexp, rather than a full log_softmax, so a large vocabulary costs one
    [N, L-1, V] float tensor, not two."""
    logits = logits[:, :-1].float() / temperature
    if keep is not None:
        logits = logits.masked_fill(~keep, float("-inf"))
    targets = input_ids[:, 1:].unsqueeze(-1)
    return logits.gather(-1, targets).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def policy_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    temperature: float, keep: torch.Tensor | None = None) -> torch.Tensor:
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
    return token_logprobs(logits, input_ids, temperature, keep)
