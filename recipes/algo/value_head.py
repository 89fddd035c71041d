"""PPO's critic: a linear value head on the policy's last hidden states.

Policy and head live in one module so one DDP wrapper averages both gradients; the engine is
fed `.policy` alone, whose parameter names are the plain HF ones it loads."""

from __future__ import annotations

import torch
from torch import nn


class ActorCritic(nn.Module):
    def __init__(self, policy: nn.Module) -> None:
        super().__init__()
        self.policy = policy
        hidden = policy.config.hidden_size
        param = next(policy.parameters())
        self.value_head = nn.Linear(hidden, 1, device=param.device, dtype=torch.float32)
        # Zero init: the critic starts predicting 0, so the first advantages are the returns.
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    @property
    def config(self):
        return self.policy.config

    def forward(self, input_ids, attention_mask=None, **_):
        out = self.policy(input_ids=input_ids, attention_mask=attention_mask,
                          output_hidden_states=True, use_cache=False)
        values = self.value_head(out.hidden_states[-1].float()).squeeze(-1)
        return out.logits, values
