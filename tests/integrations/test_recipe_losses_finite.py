"""The custom loop's update stays finite where its inputs are extreme but legal: a behaviour
logprob far below the trainer's (a bad sync, a bad engine logprob), and a minibatch of no
trained tokens (episodes aborted before their first turn). Either had written NaN into every
weight at the optimizer step, with no way back."""

import contextlib
import types

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rollout_recipes.algo.advantages import group_advantages
from rollout_recipes.algo.batch import RolloutBatch
from rollout_recipes.algo.custom_loop import CustomTrainer
from rollout_recipes.algo.losses import grpo_loss


def test_an_overflowing_ratio_on_a_zero_advantage_is_no_nan():
    """Log-ratio 100 on a group of equal rewards (advantage 0): exp overflowed to inf and
    inf x 0 made the loss NaN. The loss is the hand value, 0, and so is every gradient."""
    torch.manual_seed(0)
    head = torch.nn.Linear(4, 8)
    hidden, ids = torch.randn(2, 2, 4), torch.tensor([[2, 3], [4, 5]])
    logprobs = head(hidden).log_softmax(-1).gather(-1, ids[..., None]).squeeze(-1)
    old = logprobs.detach().clone()
    old[0, 1] = -100.0
    advantages = group_advantages(torch.tensor([1.0, 1.0]), torch.tensor([0, 0]))
    loss, stats = grpo_loss(logprobs, old, advantages, torch.ones(2, 2), 4.0, 0.2)
    loss.backward()
    assert loss.item() == 0.0
    assert all(torch.isfinite(v) for v in stats.values())
    assert all(p.grad.abs().max() == 0 for p in head.parameters())


def trainer(model) -> CustomTrainer:
    """The custom loop's update on one process, without engine or accelerate."""
    t = CustomTrainer.__new__(CustomTrainer)
    t.cfg = types.SimpleNamespace(algo="grpo", temperature=1.0, micro_batch_size=2,
                                  routing_replay=False, epochs=1, minibatches=2, beta=0.0,
                                  clip_eps=0.2, behaviour_weight_cap=2.0, max_grad_norm=1.0)
    t.module, t.routes, t.ref = model, None, None
    t.generator = torch.Generator().manual_seed(3)
    t.acc = types.SimpleNamespace(device=torch.device("cpu"), num_processes=1,
                                  backward=lambda loss: loss.backward(),
                                  no_sync=lambda m: contextlib.nullcontext(),
                                  clip_grad_norm_=torch.nn.utils.clip_grad_norm_)
    t.engine = types.SimpleNamespace(is_sleeping=True)
    t._optimizer_steps = t._awake_steps = 0
    t.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return t


def test_a_minibatch_of_no_trained_tokens_leaves_the_weights_finite():
    """Four episodes, two of them without a model token, in two minibatches (the generator's
    order puts the empty pair in one): its loss was 0 / 0."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
                                         num_hidden_layers=1, num_attention_heads=2,
                                         num_key_value_heads=2)).train()
    ids = torch.randint(0, 32, (4, 6))
    mask = torch.zeros(4, 5)
    mask[2:, 2:] = 1
    batch = RolloutBatch(ids, torch.ones_like(ids), mask, torch.zeros(4, 5),
                         torch.tensor([0.0, 1.0, 0.0, 1.0]), torch.tensor([0, 0, 1, 1]),
                         episodic=True)
    metrics = trainer(model).grpo_update(batch)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert all(v == v for v in metrics.values() if isinstance(v, float)), metrics
