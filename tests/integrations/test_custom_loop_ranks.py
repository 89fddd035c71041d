"""How the custom loop combines data-parallel ranks (recipes/algo/custom_loop.py): the loss's
token normaliser and the logged metrics, each rank played by a stand-in accelerator that sees
every rank's tensors, against the same samples as one batch on one process."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from rollout_recipes.algo.custom_loop import CustomTrainer
from rollout_recipes.algo.losses import grpo_loss


def _accelerator(per_rank: list[torch.Tensor], rank: int):
    """Rank `rank` of len(per_rank): reduce and gather see what every rank passes, which is
    `per_rank` (the tensor this rank passes must be its own entry)."""
    def reduce(tensor, reduction):
        assert torch.equal(tensor, per_rank[rank].to(tensor.dtype))
        both = torch.stack([t.to(tensor.dtype) for t in per_rank])
        return both.mean(0) if reduction == "mean" else both.sum(0)

    def gather(tensor):
        assert torch.equal(tensor, per_rank[rank].to(tensor.dtype))
        return torch.cat([t.to(tensor.dtype) for t in per_rank])

    return SimpleNamespace(num_processes=len(per_rank), device=torch.device("cpu"),
                           reduce=reduce, gather=gather)


def test_ranks_gradient_is_the_token_mean_over_every_ranks_samples():
    """Rank 0 holds two 1-token completions, rank 1 completions of 8 and 6 tokens. Each rank
    divides its token sum by what _tokens_per_rank gives and DDP averages the gradients: that
    must be the gradient of the per-token mean over all four samples (by each rank's own count
    a token of rank 0 weighed 7x one of rank 1)."""
    old = torch.full((4, 8), -1.0, dtype=torch.float64)
    advantages = torch.tensor([1.0, -1.0, 1.0, -1.0], dtype=torch.float64)
    mask = torch.zeros(4, 8, dtype=torch.float64)
    mask[0, :1] = mask[1, :1] = 1
    mask[2, :8] = 1
    mask[3, :6] = 1
    logprobs = (old + 0.01 * torch.arange(32, dtype=torch.float64).view(4, 8)).requires_grad_()
    ranks = [slice(0, 2), slice(2, 4)]
    local = [mask[r].sum() for r in ranks]
    ddp = 0
    for rank, rows in enumerate(ranks):
        trainer = SimpleNamespace(acc=_accelerator(local, rank))
        num_tokens = CustomTrainer._tokens_per_rank(trainer, local[rank])
        loss, _ = grpo_loss(logprobs[rows], old[rows], advantages[rows], mask[rows], num_tokens,
                            0.2)
        ddp = ddp + torch.autograd.grad(loss, logprobs)[0] / len(ranks)
    one, _ = grpo_loss(logprobs, old, advantages, mask, mask.sum(), 0.2)
    torch.testing.assert_close(ddp, torch.autograd.grad(one, logprobs)[0], rtol=1e-12, atol=0)


def test_logged_extremes_are_extremes_over_ranks():
    """Means are averaged over ranks, but a max is the largest rank's and a min the smallest's
    (a broken sync on one rank must not be halved in the log); asleep only if every rank was."""
    ranks = [{"reward/mean": 0.5, "completion/max_length": 4.0,
              "mismatch/logprob_gap_max": 1e-7, "mismatch/ratio_min": 0.999,
              "mismatch/ratio_max": 1.001, "partial/staleness_max": 0.0,
              "engine/asleep_at_optimizer_step": 1.0},
             {"reward/mean": 0.7, "completion/max_length": 16.0,
              "mismatch/logprob_gap_max": 3.0, "mismatch/ratio_min": 0.05,
              "mismatch/ratio_max": 20.0, "partial/staleness_max": 2.0,
              "engine/asleep_at_optimizer_step": 0.0}]
    keys = sorted(ranks[0])
    rows = [torch.tensor([[r[k] for k in keys]], dtype=torch.float64) for r in ranks]
    trainer = SimpleNamespace(acc=_accelerator(rows, 0))
    out = CustomTrainer._mean_over_ranks(trainer, ranks[0])
    assert out["reward/mean"] == 0.6
    assert out["completion/max_length"] == 16.0 and out["partial/staleness_max"] == 2.0
    assert out["mismatch/logprob_gap_max"] == 3.0 and out["mismatch/ratio_max"] == 20.0
    assert out["mismatch/ratio_min"] == 0.05
    assert out["engine/asleep_at_optimizer_step"] == 0.0
