"""Watched optimizers (rollout.watch_optimizer): a step counts as a weight change for the models
whose parameters it steps, and for no other. Two trainer models in one process, each with its own
optimizer and engine, sync only when their own weights moved.

The steps are fused AdamW's, whose kernels bump no autograd version counter: only the watch
sees them."""

import gc
import weakref

import pytest
import torch
from lora_models import peft_model
from models import tiny_model
from test_colocation import CONFIG, DDPLike

from rollout import Engine, watch_optimizer
from rollout.colocation.weights import weights_version
from trainer_hooks import ColocatedRollout


def step(optimizer) -> None:
    for group in optimizer.param_groups:
        for p in group["params"]:
            p.grad = torch.ones_like(p)
    optimizer.step()


def fused_adamw(params):
    return torch.optim.AdamW(params, lr=0.1, fused=True)


WRAPPERS = {"plain": lambda seed: tiny_model("qwen2", seed=seed),
            "ddp": lambda seed: DDPLike(tiny_model("qwen2", seed=seed)),
            "peft": lambda seed: peft_model("qwen2", seed=seed)}


def rollout_of(model, optimizer) -> ColocatedRollout:
    engine = Engine(model.module if isinstance(model, DDPLike) else model, CONFIG)
    return ColocatedRollout(engine, model, optimizer=optimizer)


@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_a_step_syncs_its_own_models_engine_only(wrapper):
    models = [WRAPPERS[wrapper](seed) for seed in (0, 1)]
    optimizers = [fused_adamw([p for p in m.parameters() if p.requires_grad]) for m in models]
    rollouts = [rollout_of(m, o) for m, o in zip(models, optimizers)]
    for stepped in (0, 1, 1, 0):
        step(optimizers[stepped])
        synced = []
        for rollout in rollouts:
            with rollout:
                synced.append(rollout.synced)
        assert synced == [i == stepped for i in range(2)]


def test_a_step_counts_for_the_parameters_the_optimizer_holds_at_that_step():
    """Param groups added after the watch count; an optimizer holding parameters of two models
    counts for both."""
    a, b = tiny_model("qwen2", seed=0), tiny_model("qwen2", seed=1)
    optimizer = fused_adamw(a.parameters())
    ra, rb = rollout_of(a, optimizer), rollout_of(b, None)
    step(optimizer)
    with ra, rb:
        assert (ra.synced, rb.synced) == (True, False)
    optimizer.add_param_group({"params": [b.model.norm.weight]})
    step(optimizer)
    with ra, rb:
        assert (ra.synced, rb.synced) == (True, True)


def test_neither_the_watch_nor_a_version_keeps_an_optimizer_alive():
    model = tiny_model("qwen2")
    optimizer = fused_adamw(model.parameters())
    watch_optimizer(optimizer)
    before = weights_version(model)
    step(optimizer)
    after = weights_version(model)  # held on, as a ColocatedRollout holds its synced version
    assert after != before
    gone = weakref.ref(optimizer)
    del optimizer
    gc.collect()
    assert gone() is None


def test_an_optimizer_of_master_copies_counts_for_the_model_it_was_watched_for():
    """fp32 master weights (DeepSpeed ZeRO-1/2, apex): the optimizer steps copies and writes
    them back through `.data`, which no counter sees, and holds none of the model's
    parameters. Watched for the model (ColocatedRollout names its own), its steps sync that
    model's engine and no other's (they had synced none: matching by parameters alone)."""
    models = [tiny_model("qwen2", seed=seed) for seed in (0, 1)]
    params = list(models[0].parameters())
    masters = [p.detach().clone().requires_grad_(True) for p in params]
    optimizer = fused_adamw(masters)
    rollouts = [rollout_of(models[0], optimizer), rollout_of(models[1], None)]
    for rollout in rollouts:
        with rollout:
            pass
    step(optimizer)
    with torch.no_grad():
        for p, master in zip(params, masters):
            p.data.copy_(master.data)  # (.data: no version counter moves)
    synced = []
    for rollout in rollouts:
        with rollout:
            synced.append(rollout.synced)
    assert synced == [True, False]
    with pytest.raises(ValueError, match="model must be an nn.Module"):
        watch_optimizer(optimizer, "model")
