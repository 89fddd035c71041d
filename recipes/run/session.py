"""One training run from a RecipeConfig: set up, warm start, score, train, score again, report.

The held-out accuracy is taken greedily through the engine right before and right after RL, so
"before" already includes the supervised warm start: the difference is what RL added.
"""

from __future__ import annotations

import os
import time

import torch

from ..tasks import builtin_alphabet, load_task
from .build import build_engine, frozen_copy, load_model, load_tokenizer
from .config import RecipeConfig, check_world
from .evaluate import held_out_accuracy, held_out_episode_accuracy, later_turn_cache
from .plot import reward_curve
from .shard import engine_slot
from .tracking import Tracker


def train(cfg: RecipeConfig) -> dict:
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs, set_seed

    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    set_seed(cfg.seed)
    # PPO's warm start trains the policy only: the value head gets no gradient then.
    ddp = DistributedDataParallelKwargs(find_unused_parameters=cfg.algo == "ppo")
    # cpu=True when there is no GPU: with it, a multi-process launch runs DDP over gloo.
    accelerator = Accelerator(cpu=not torch.cuda.is_available(), kwargs_handlers=[ddp])
    # Read now: TRL's Trainer builds its own Accelerator, which resets the shared state ours
    # reads from.
    is_main, processes = accelerator.is_main_process, accelerator.num_processes
    check_world(cfg, processes)  # before the tracker creates files or any model is built
    tracker = Tracker(cfg, is_main)
    started = time.perf_counter()
    try:
        tokenizer = load_tokenizer(cfg, builtin_alphabet(cfg))
        with accelerator.main_process_first():  # download / cache the dataset once
            task = load_task(cfg, tokenizer)
        policy = load_model(cfg, tokenizer, accelerator.device)
        tracker.print(f"model: {cfg.model or 'built-in tiny Llama'} "
                      f"({sum(p.numel() for p in policy.parameters()) / 1e6:.2f}M parameters), "
                      f"task: {cfg.dataset or cfg.task} ({len(task.train)} train prompts), "
                      f"{processes} process(es), {processes // cfg.tensor_parallel_size} "
                      f"engine(s) of {cfg.tensor_parallel_size} rank(s)")
        if cfg.trainer == "trl":
            from ..algo.trl_loop import train_trl

            result = train_trl(cfg, accelerator, policy, tokenizer, task, tracker)
        elif cfg.trainer == "trl_async":
            from ..algo.trl_async_loop import train_trl_async

            result = train_trl_async(cfg, accelerator, policy, tokenizer, task, tracker)
        else:
            result = _train_custom(cfg, accelerator, policy, tokenizer, task, tracker)
        result["seconds"] = time.perf_counter() - started
        result["processes"] = processes
        tracker.set_summary(**{k: v for k, v in result.items() if v is not None})
        if cfg.plot and is_main and tracker.history:
            result["plot"] = reward_curve(
                tracker.history, os.path.join(cfg.output_dir, "reward_curve.png"),
                title=f"{cfg.algo.upper()} ({cfg.trainer}) on {cfg.dataset or cfg.task}",
                accuracy={"before": result.get("accuracy_before"),
                          "after": result.get("accuracy_after")})
    finally:
        tracker.finish()
        _leave_process_group(accelerator)
    return {**result, "history": tracker.history, "summary": tracker.summary,
            "metrics_path": tracker.jsonl_path, "wandb_dir": tracker.wandb_dir,
            "wandb_mode": tracker.wandb_mode,
            "output_dir": cfg.output_dir}


def _leave_process_group(accelerator) -> None:
    """Tear the gloo/NCCL group down explicitly: left to interpreter exit, its destructor can
    race with its own threads and abort a rank ("terminate called without an active
    exception") after the run itself succeeded."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        accelerator.wait_for_everyone()
        dist.destroy_process_group()


def _train_custom(cfg, accelerator, policy, tokenizer, task, tracker) -> dict:
    from trainer_hooks.colocate import ColocatedRollout

    from ..algo.custom_loop import CustomTrainer
    from ..algo.value_head import ActorCritic
    from ..algo.warmstart import warm_start

    module = ActorCritic(policy) if cfg.algo == "ppo" else policy
    optimizer = torch.optim.AdamW(module.parameters(), lr=cfg.learning_rate,
                                  weight_decay=cfg.weight_decay)
    module, optimizer = accelerator.prepare(module, optimizer)
    slot = engine_slot(accelerator.process_index, accelerator.num_processes,
                       cfg.tensor_parallel_size)
    engine = build_engine(cfg, policy, tokenizer, slot.index)
    engine.sleep(cfg.sleep_level)  # asleep until the first rollout: warm start needs no engine
    # synced=False: DDP broadcast rank 0's weights into `policy` without bumping versions.
    rollout = ColocatedRollout(engine, policy, cfg.sleep_level, synced=False,
                               optimizer=optimizer, carry=cfg.partial_rollouts)
    out: dict = {}
    if cfg.warmstart_steps:
        out["warmstart_loss"] = warm_start(cfg, module, tokenizer, task, accelerator)
    ref = frozen_copy(policy) if cfg.beta > 0 else None  # the policy RL starts from
    out["accuracy_before"] = _score(cfg, rollout, task, tokenizer, accelerator, tracker)
    trainer = CustomTrainer(cfg, accelerator, module, optimizer, rollout, tokenizer, task,
                            tracker, ref)

    def evaluate() -> float:
        return _accuracy(cfg, rollout, task, tokenizer, accelerator)

    out["accuracy_after"] = trainer.train(evaluate if task.eval is not None else None)
    if out["accuracy_after"] is not None:
        tracker.print(f"held-out accuracy after RL: {out['accuracy_after']:.1%} "
                      f"({len(task.eval)} prompts, greedy)")
    out["engine_stats"] = engine.stats.as_dict()
    if task.environment is not None and task.eval is not None:
        out["later_turn_cache"] = later_turn_cache(rollout, task, tokenizer, cfg, accelerator)
    return out


def _score(cfg, rollout, task, tokenizer, accelerator, tracker) -> float | None:
    if task.eval is None:
        return None
    acc = _accuracy(cfg, rollout, task, tokenizer, accelerator, progress=cfg.progress)
    tracker.print(f"held-out accuracy before RL: {acc:.1%} ({len(task.eval)} prompts, greedy)")
    return acc


def _accuracy(cfg, rollout, task, tokenizer, accelerator, progress: bool = False) -> float:
    if task.environment is not None:  # greedy multi-turn episodes with the environment
        return held_out_episode_accuracy(rollout, task, tokenizer, cfg, accelerator, progress)
    return held_out_accuracy(rollout, task, tokenizer, cfg.max_new_tokens, accelerator,
                             progress)
