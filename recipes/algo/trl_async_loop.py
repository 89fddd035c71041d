"""`--trainer trl_async`: TRL's asynchronous GRPO trainer (`AsyncGRPOTrainer`) with the engine as
its rollout worker and weight transfer (trainer_hooks.trl_async): generation runs on in a thread
of this process while the trainer steps, groups are carried across weight syncs, and samples
older than `max_staleness` versions are restarted by the engine or dropped by TRL.

AsyncGRPOTrainer loads its policy from a checkpoint path, so the (warm-started) policy is saved
under `output_dir/policy` first and both the trainer and the engine load it. TRL's training
forward takes a flash-attention kernel: it trains on GPUs. One process, one engine."""

from __future__ import annotations

import os

from transformers import TrainerCallback

from ..run.build import engine_config
from ..run.config import RecipeConfig, forward_split
from ..run.evaluate import held_out_accuracy
from .trl_loop import _ALIASES, correctness_reward


def async_args(cfg: RecipeConfig, accelerator):
    from trl.experimental.async_grpo import AsyncGRPOConfig

    # One optimizer step trains prompts_per_step groups, as one step of the other loops, in
    # forwards of at most micro_batch_size sequences: TRL's step is per_device_train_batch_size
    # x gradient_accumulation_steps samples (its samples_per_step, one process), in TRL's
    # fixed-count batches (token_budget <= 0; under a token budget a micro-batch takes what
    # fits and the batch size is ignored).
    micro, accumulate = forward_split(cfg.prompts_per_step * cfg.num_generations,
                                      cfg.micro_batch_size)
    return AsyncGRPOConfig(
        output_dir=f"{cfg.output_dir}/trl_async", run_name=cfg.run_name, seed=cfg.seed,
        use_cpu=accelerator.device.type == "cpu", bf16=False,
        max_steps=cfg.steps, num_generations=cfg.num_generations,
        per_device_train_batch_size=micro, gradient_accumulation_steps=accumulate,
        token_budget=-1,
        # TRL's default is True; the recipe's key decides, as in the other trainers.
        gradient_checkpointing=cfg.gradient_checkpointing,
        max_completion_length=cfg.max_new_tokens, temperature=cfg.temperature,
        top_p=cfg.top_p, top_k=cfg.top_k, min_p=cfg.min_p or None,
        learning_rate=cfg.learning_rate, lr_scheduler_type="constant",
        weight_decay=cfg.weight_decay, max_grad_norm=cfg.max_grad_norm, epsilon=cfg.clip_eps,
        max_staleness=cfg.max_staleness,  # an int: RecipeConfig refuses null for trl_async
        logging_steps=1, save_strategy="no", report_to=[], disable_tqdm=not cfg.progress)


class _ToTracker(TrainerCallback):
    def __init__(self, tracker) -> None:
        self.tracker = tracker

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            row = dict(logs) | {new: logs[old] for old, new in _ALIASES.items() if old in logs}
            self.tracker.log(row, state.global_step)


def train_trl_async(cfg: RecipeConfig, accelerator, policy, tokenizer, task, tracker) -> dict:
    from rollout import Engine
    from trainer_hooks.colocate import ColocatedRollout
    from trainer_hooks.trl_async import engine_async_grpo

    from .warmstart import warm_start

    out: dict = {}
    if cfg.warmstart_steps:
        out["warmstart_loss"] = warm_start(cfg, policy, tokenizer, task, accelerator)
    path = os.path.join(cfg.output_dir, "policy")
    policy.save_pretrained(path)
    tokenizer.save_pretrained(path)
    engine = Engine(path, engine_config(cfg), tokenizer=tokenizer)
    # on_support: RecipeConfig refuses it under truncation, and untruncated the engine's
    # sampling logprobs are its untruncated ones.
    ratio = "full_policy" if cfg.importance_ratio == "full_policy" else "untruncated"
    trainer = engine_async_grpo(engine, path, [correctness_reward(task, tokenizer, engine.eos_ids)],
                                async_args(cfg, accelerator), task.train, tokenizer,
                                importance_ratio=ratio)
    trainer.add_callback(_ToTracker(tracker))
    scorer = ColocatedRollout(engine, trainer.model, cfg.sleep_level, synced=False)
    if task.eval is not None:
        out["accuracy_before"] = held_out_accuracy(scorer, task, tokenizer, cfg.max_new_tokens,
                                                   trainer.accelerator)
    engine.wake_up()  # the worker rolls out while the trainer steps: awake throughout
    trainer.train()
    if task.eval is not None:
        out["accuracy_after"] = held_out_accuracy(scorer, task, tokenizer, cfg.max_new_tokens,
                                                  trainer.accelerator)
    out["engine_stats"] = engine.stats.as_dict()
    return out
