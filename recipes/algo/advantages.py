"""Advantages: how much better than expected each sample (GRPO) or token (PPO) did.

GRPO normalises rewards within each prompt's group of samples; PPO runs GAE over a value head's
estimates (value_head.py) on [N, L-1] token tensors (see batch.py for the layout).

Multi-turn episodes: GRPO's unit is the episode (the n episodes of a prompt are its group, and
every model token of an episode carries its advantage); PPO runs `episode_gae`, where the
environment's tokens are not time steps (see there).
"""

from __future__ import annotations

import torch


def group_advantages(rewards: torch.Tensor, group: torch.Tensor, eps: float = 1e-4
                     ) -> torch.Tensor:
    """(r - mean) / (std + eps) within each prompt's group: a group whose samples all score the
    same carries no signal and gets advantage 0."""
    num_groups = int(group.max()) + 1
    count = torch.zeros(num_groups, device=rewards.device).index_add_(0, group,
                                                                       torch.ones_like(rewards))
    mean = torch.zeros(num_groups, device=rewards.device).index_add_(0, group, rewards) / count
    centred = rewards - mean[group]
    var = torch.zeros(num_groups, device=rewards.device).index_add_(0, group, centred ** 2)
    std = (var / (count - 1).clamp(min=1)).sqrt()
    return centred / (std[group] + eps)


def gae(rewards, values, mask, gamma: float, lam: float):
    """Generalised advantage estimation over each row's contiguous completion tokens.

    `rewards`, `values`, `mask`: [N, T]. Returns (advantages, returns), zero off the mask."""
    n, t_len = rewards.shape
    advantages = torch.zeros_like(rewards)
    last = torch.zeros(n, device=rewards.device)
    for t in reversed(range(t_len)):
        if t + 1 < t_len:
            next_mask = mask[:, t + 1]
            next_value = values[:, t + 1] * next_mask
        else:
            next_mask = next_value = torch.zeros(n, device=rewards.device)
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        last = delta + gamma * lam * next_mask * last
        advantages[:, t] = last * mask[:, t]
    return advantages, (advantages + values) * mask


def episode_gae(rewards, values, mask, gamma: float, lam: float):
    """GAE over each row's model tokens (mask 1), the environment's tokens (mask 0 between
    them) skipped: they are not actions, so they earn no reward, take no value and get no
    advantage, and are not discount steps (a long tool output does not discount what follows).
    The state a turn's last token leads to is the next turn's first model token, whose value
    was computed with the observation in context: the return bootstraps through the environment
    from there, so an early turn (a tool call) is credited with the reward the answer earns.
    On a contiguous mask this is `gae`.

    `rewards`, `values`, `mask`: [N, T]. Returns (advantages, returns), zero off the mask."""
    n, t_len = rewards.shape
    advantages = torch.zeros_like(rewards)
    last = torch.zeros(n, device=rewards.device)  # the advantage at the next model token
    next_value = torch.zeros(n, device=rewards.device)  # the value at the next model token
    for t in reversed(range(t_len)):
        model = mask[:, t] > 0
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        last = torch.where(model, delta + gamma * lam * last, last)
        next_value = torch.where(model, values[:, t], next_value)
        advantages[:, t] = last * mask[:, t]
    return advantages, (advantages + values) * mask


def whiten(x, mask, eps: float = 1e-8):
    mean = (x * mask).sum() / mask.sum()
    var = (((x - mean) ** 2) * mask).sum() / mask.sum()
    return (x - mean) * torch.rsqrt(var + eps) * mask
