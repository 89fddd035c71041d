"""A step's rollouts as padded training tensors.

Token-level tensors are in "target" space, [N, L-1]: column j scores input_ids[:, j+1], the token
the model predicts from position j. Only completion tokens are trained on (`mask`), and the
engine's logprobs, log_softmax(logits / T) of each sampled token, fill `old_logprobs` there:
they are the behaviour policy of the importance ratio, so no extra forward is needed for them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rollout import RolloutOutput


@dataclass
class RolloutBatch:
    input_ids: torch.Tensor  # [N, L] prompt + completion, right-padded
    attention_mask: torch.Tensor  # [N, L]
    mask: torch.Tensor  # [N, L-1] float, 1 on completion targets
    old_logprobs: torch.Tensor  # [N, L-1] behaviour-policy logprobs (from the engine)
    rewards: torch.Tensor  # [N]
    group: torch.Tensor  # [N] index of the prompt each sample answers
    completions: list[str]

    @property
    def size(self) -> int:
        return self.input_ids.shape[0]

    @property
    def completion_lengths(self) -> torch.Tensor:
        return self.mask.sum(1)

    def rows(self, index: torch.Tensor) -> dict[str, torch.Tensor]:
        """The tensors of some samples, for a minibatch or micro-batch."""
        return {"input_ids": self.input_ids[index], "attention_mask": self.attention_mask[index],
                "mask": self.mask[index], "old_logprobs": self.old_logprobs[index]}


def build_batch(outputs: list[RolloutOutput], rewards: list[float], pad_id: int,
                device: torch.device) -> RolloutBatch:
    seqs, starts, logps, groups, texts = [], [], [], [], []
    for g, out in enumerate(outputs):
        for s in out.samples:
            seqs.append(list(out.prompt_token_ids) + list(s.token_ids))
            starts.append(len(out.prompt_token_ids))
            logps.append(s.logprobs)
            groups.append(g)
            texts.append(s.text or "")
    n, length = len(seqs), max(map(len, seqs))
    input_ids = torch.full((n, length), pad_id, dtype=torch.long)
    attention = torch.zeros(n, length, dtype=torch.long)
    mask = torch.zeros(n, length - 1)
    old = torch.zeros(n, length - 1)
    for i, (ids, start, lp) in enumerate(zip(seqs, starts, logps)):
        input_ids[i, :len(ids)] = torch.tensor(ids)
        attention[i, :len(ids)] = 1
        # The first completion token is predicted from the last prompt position.
        mask[i, start - 1:len(ids) - 1] = 1
        old[i, start - 1:len(ids) - 1] = torch.tensor(lp, dtype=torch.float32)
    return RolloutBatch(input_ids.to(device), attention.to(device), mask.to(device),
                        old.to(device), torch.tensor(rewards, device=device),
                        torch.tensor(groups, device=device), texts)
