"""A step's rollouts as padded training tensors.

Token-level tensors are in "target" space, [N, L-1]: column j scores input_ids[:, j+1], the token
the model predicts from position j. Only completion tokens are trained on (`mask`), and the
engine's logprobs, log_softmax(logits / T) of each sampled token, fill `old_logprobs` there:
they are the behaviour policy of the importance ratio, so no extra forward is needed for them.

Multi-turn episodes (rollout.agent) lay out the same way, prompt + everything after it, but
`mask` is the episode's own: 1 on the model's tokens, 0 on the environment's (tool output), which
stay in `input_ids` as context and are never trained on. Everything downstream (losses, KL,
values, the token counts that normalise the loss) weighs tokens by `mask`, so this is the one
place where the environment's tokens are told apart.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rollout import RolloutOutput
from rollout.agent import Episode


@dataclass
class RolloutBatch:
    input_ids: torch.Tensor  # [N, L] prompt + completion, right-padded
    attention_mask: torch.Tensor  # [N, L]
    mask: torch.Tensor  # [N, L-1] float, 1 on completion targets
    old_logprobs: torch.Tensor  # [N, L-1] behaviour-policy logprobs (from the engine)
    rewards: torch.Tensor  # [N]
    group: torch.Tensor  # [N] index of the prompt each sample answers
    episodic: bool = False  # built from multi-turn episodes: `mask` has environment gaps
    # Per sample: (target position of its first completion token, its Support), where the
    # sampler truncated and the trainer renormalises over the kept tokens; None: it does not.
    supports: list | None = None
    # Partial rollouts' decoupled objective (losses.py): the engine's logprobs, from whichever
    # weights sampled each token, move here, and `old_logprobs` becomes the proximal policy's
    # (the trainer's at the start of the step). None: old_logprobs is the behaviour policy.
    behaviour_logprobs: torch.Tensor | None = None

    @property
    def size(self) -> int:
        return self.input_ids.shape[0]

    @property
    def completion_lengths(self) -> torch.Tensor:
        return self.mask.sum(1)

    def rows(self, index: torch.Tensor) -> dict[str, torch.Tensor]:
        """The tensors of some samples, for a minibatch or micro-batch; "keep" (bool
        [n, L-1, V]: the tokens each position's sampler kept) where the batch has supports."""
        rows = {"input_ids": self.input_ids[index], "attention_mask": self.attention_mask[index],
                "mask": self.mask[index], "old_logprobs": self.old_logprobs[index]}
        if self.supports is not None:
            rows["keep"] = self._keep(index.tolist())
        if self.behaviour_logprobs is not None:
            rows["behaviour_logprobs"] = self.behaviour_logprobs[index]
        return rows

    def _keep(self, samples: list[int]) -> torch.Tensor:
        vocab = self.supports[0][1].vocab_size
        keep = torch.ones(len(samples), self.mask.shape[1], vocab, dtype=torch.bool,
                          device=self.mask.device)
        for row, i in enumerate(samples):
            start, support = self.supports[i]
            keep[row, start:start + len(support)] = support.mask(keep.device)
        return keep


def build_batch(outputs: list[RolloutOutput], rewards: list[float], pad_id: int,
                device: torch.device, behaviour: str = "logprobs") -> RolloutBatch:
    """`behaviour`: the engine's logprobs that fill `old_logprobs`: "logprobs" (the
    untruncated policy's), "sampling" (the truncated distribution's, Sample.sampling_logprobs)
    or "on_support" (those, and each sample's support for the trainer to renormalise over)."""
    sampling = behaviour != "logprobs"
    samples = [(out, s) for out in outputs for s in out.samples]
    rows = [(out.prompt_token_ids, s.token_ids, [1] * len(s.token_ids),
             s.sampling_logprobs if sampling else s.logprobs) for out, s in samples]
    groups = [g for g, out in enumerate(outputs) for _ in out.samples]
    batch = _pack(rows, rewards, groups, pad_id, device)
    if behaviour == "on_support":
        batch.supports = [(len(out.prompt_token_ids) - 1, s.support) for out, s in samples]
    return batch


def build_episode_batch(episodes: list[list[Episode]], rewards: list[float], pad_id: int,
                        device: torch.device, behaviour: str = "logprobs") -> RolloutBatch:
    """`episodes[i]`: the n episodes of prompt i (one GRPO group); `rewards`: one per episode,
    in that order. Targets are masked by each episode's mask,
    and `old_logprobs` holds the engine's logprobs at model tokens only (0 at environment
    tokens, whatever the episode says there); `behaviour` "sampling": its sampling logprobs
    (what a truncating sampler drew from; episodes carry no supports)."""
    sampling = behaviour != "logprobs"
    flat = [ep for row in episodes for ep in row]
    rows = [(ep.prompt_ids, ep.token_ids, ep.mask,
             ep.sampling_logprobs if sampling else ep.logprobs) for ep in flat]
    groups = [g for g, row in enumerate(episodes) for _ in row]
    return _pack(rows, rewards, groups, pad_id, device, episodic=True)


def _pack(rows, rewards, groups, pad_id, device, episodic: bool = False) -> RolloutBatch:
    """(prompt ids, ids after it, their mask, their logprobs) per sample -> right-padded tensors
    in target space: the first token after the prompt is predicted from its last position."""
    n, length = len(rows), max(len(p) + len(t) for p, t, _, _ in rows)
    input_ids = torch.full((n, length), pad_id, dtype=torch.long)
    attention = torch.zeros(n, length, dtype=torch.long)
    mask = torch.zeros(n, length - 1)
    old = torch.zeros(n, length - 1)
    for i, (prompt, tokens, m, lp) in enumerate(rows):
        ids = list(prompt) + list(tokens)
        input_ids[i, :len(ids)] = torch.tensor(ids)
        attention[i, :len(ids)] = 1
        targets = slice(len(prompt) - 1, len(ids) - 1)
        mask[i, targets] = torch.tensor(m, dtype=torch.float32)
        trained = mask[i, targets] > 0
        old[i, targets] = _at_trained(trained, lp)
    return RolloutBatch(input_ids.to(device), attention.to(device), mask.to(device),
                        old.to(device), torch.tensor(rewards, device=device),
                        torch.tensor(groups, device=device), episodic)


def _at_trained(trained: torch.Tensor, logprobs: list[float]) -> torch.Tensor:
    """A sample's logprobs where it is trained on, 0 elsewhere (an environment token's entry
    says nothing)."""
    return torch.where(trained, torch.tensor(logprobs, dtype=torch.float32), 0.0)

