"""GRPO and PPO objectives on [N, L-1] token tensors (see batch.py for the layout; the
advantages they weigh come from advantages.py).

Losses are token-level sums divided by `num_tokens`, the completion tokens of the whole
minibatch, so micro-batches add up to the minibatch's mean and long completions are not
down-weighted per token (the sample-level mean of the original GRPO paper does that).

Partial rollouts train on tokens sampled by older policies (rollout/engine/carry.py). Their
objective is decoupled: the clipped ratio is taken against the *proximal* policy (the trainer's
at the start of the step, recomputed), and each token is weighted by pi_prox / mu, its
behaviour policy mu being the engine's logprob from the weights that sampled it, truncated at
a cap (`behaviour_weights`). On-policy the weight is 1 and the loss is the plain one.
"""

from __future__ import annotations

import torch


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Unbiased, non-negative per-token estimate of KL(policy || reference) (Schulman's k3)."""
    delta = ref_logprobs - logprobs
    return torch.exp(delta) - delta - 1


# The log-ratio's bound before exp: past ~88.7 float32's exp is inf, and inf x a zero advantage
# (every token of a group of equal rewards) is NaN, which the optimizer step writes into every
# weight. exp(20) ~ 4.9e8 is far past any clip range, so the clipped term still decides.
LOG_RATIO_LIMIT = 20.0


def clipped_policy_loss(logprobs, old_logprobs, advantages, clip_eps, weights=None):
    """-w min(r A, clip(r, 1 ± eps) A) per token (w: behaviour_weights, or 1), and whether the
    clip was active."""
    ratio = torch.exp((logprobs - old_logprobs).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))
    unclipped = ratio * advantages
    clipped = ratio.clamp(1 - clip_eps, 1 + clip_eps) * advantages
    loss = -torch.minimum(unclipped, clipped)
    return loss if weights is None else weights * loss, (clipped < unclipped).float(), ratio


def behaviour_weights(proximal, behaviour, cap: float) -> torch.Tensor:
    """Decoupled PPO's per-token importance weight pi_prox / mu, truncated at `cap` (the
    variance of a token sampled by a much older policy stays bounded), without gradient."""
    return torch.exp(proximal - behaviour).clamp(max=cap).detach()


def grpo_loss(logprobs, old_logprobs, advantages, mask, num_tokens, clip_eps,
              ref_logprobs=None, beta: float = 0.0, weights=None):
    """`advantages` is per sample [N]; every token of a sample shares it. `weights`: the
    decoupled objective's behaviour_weights (old_logprobs are then the proximal policy's)."""
    per_token, clipped, ratio = clipped_policy_loss(logprobs, old_logprobs,
                                                    advantages.unsqueeze(1), clip_eps, weights)
    stats = {}
    if ref_logprobs is not None and beta > 0:
        kl = kl_k3(logprobs, ref_logprobs)
        per_token = per_token + beta * kl
        stats["kl"] = _sum(kl, mask)
    loss = _sum(per_token, mask) / num_tokens
    stats |= _ratio_stats(ratio, clipped, mask)
    return loss, stats


def ppo_loss(logprobs, old_logprobs, values, old_values, returns, advantages, mask, num_tokens,
             clip_eps, value_clip, vf_coef, weights=None):
    """Clipped policy loss (weighted as in grpo_loss) plus vf_coef x clipped value loss (max of
    clipped and unclipped)."""
    pg, clipped, ratio = clipped_policy_loss(logprobs, old_logprobs, advantages, clip_eps,
                                             weights)
    v_clipped = old_values + (values - old_values).clamp(-value_clip, value_clip)
    vf = 0.5 * torch.maximum((values - returns) ** 2, (v_clipped - returns) ** 2)
    loss = (_sum(pg, mask) + vf_coef * _sum(vf, mask)) / num_tokens
    return loss, {"policy_loss": _sum(pg.detach(), mask), "value_loss": _sum(vf.detach(), mask),
                  **_ratio_stats(ratio, clipped, mask)}


def _ratio_stats(ratio, clipped, mask) -> dict:
    """Token sums: how far the trained policy has moved from the one that sampled."""
    ratio = ratio.detach()
    return {"clip_frac": _sum(clipped, mask), "ratio": _sum(ratio, mask),
            "ratio_abs_dev": _sum((ratio - 1).abs(), mask),
            "ratio_outside": _sum(((ratio - 1).abs() > 0.1).float(), mask)}


def mismatch_stats(logprobs, old_logprobs, mask) -> dict:
    """How far the trainer's logprobs are from the rollout's at the same policy (the first
    minibatch, before any step): token sums of |delta| and of old - new (an estimate of
    KL(behaviour || policy)), and the extremes of |delta| and of the ratio, as tensors."""
    delta = (logprobs.detach() - old_logprobs) * mask
    ratio = torch.exp(delta)[mask > 0]
    if not ratio.numel():
        ratio = delta.new_ones(1)
    return {"gap": delta.abs().sum(), "kl": -delta.sum(), "gap_max": delta.abs().max(),
            "ratio_min": ratio.min(), "ratio_max": ratio.max()}


def _sum(x, mask):
    return (x * mask).sum()
