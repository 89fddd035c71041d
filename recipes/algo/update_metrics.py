"""What a GRPO / PPO update of the custom loop (custom_loop.py) logs: micro-batch statistics
reduced over a minibatch, the importance ratio and the rollout-vs-trainer mismatch, the share of
groups whose rewards differ."""

from __future__ import annotations

import math
import sys

from .batch import RolloutBatch

_LARGEST_EXP = math.log(sys.float_info.max)  # math.exp raises OverflowError past it


def extreme(key: str) -> str | None:
    """"max" or "min" for a statistic that is an extreme (reduced by it over micro-batches and
    ranks, not summed or averaged), else None."""
    if key.endswith(("_max", "/max_length")):
        return "max"
    return "min" if key.endswith("_min") else None


def reduce_stat(key: str, total: float | None, value: float) -> float:
    """Micro-batch statistics: extremes by max or min, the rest summed."""
    if total is None:
        return value
    kind = extreme(key)
    if kind is not None:
        return (max if kind == "max" else min)(total, value)
    return total + value


def ratio_metrics(totals: dict, tokens: float) -> dict:
    """The importance ratio over every minibatch, and the rollout-vs-trainer mismatch of the
    first (before any optimizer step): the logprob gap (mean, max), the token probability's
    multiplicative error exp(mean |gap|), the ratio's extremes and an estimate of
    KL(behaviour || policy)."""
    # (no trained tokens: every token sum is 0, and so is its mean)
    first, tokens = max(totals["mismatch/tokens"], 1), max(tokens, 1)
    gap = totals["mismatch/gap"] / first
    weights = ({"is/weight_mean": totals["is_weight"] / tokens,
                "is/capped_frac": totals["is_capped"] / tokens} if "is_weight" in totals else {})
    return weights | {
        "loss/clip_frac": totals["clip_frac"] / tokens, "loss/ratio": totals["ratio"] / tokens,
        "loss/ratio_abs_dev": totals["ratio_abs_dev"] / tokens,
        "loss/ratio_outside": totals["ratio_outside"] / tokens,
        "mismatch/logprob_gap_mean": gap,
        "mismatch/logprob_gap_max": totals["mismatch/gap_max"],
        # inf rather than an OverflowError when a broken sync makes the gap huge
        "mismatch/prob_error": math.inf if gap > _LARGEST_EXP else math.exp(gap),
        "mismatch/ratio_min": totals["mismatch/ratio_min"],
        "mismatch/ratio_max": totals["mismatch/ratio_max"],
        "mismatch/kl": totals["mismatch/kl"] / first}


def groups_with_signal(batch: RolloutBatch) -> float:
    """Share of prompts whose samples got different rewards: only those move a GRPO step."""
    groups = batch.group.unique()
    mixed = [batch.rewards[batch.group == g].std() > 0 for g in groups]
    return sum(bool(m) for m in mixed) / len(groups)
