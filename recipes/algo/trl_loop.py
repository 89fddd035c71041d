"""`--trainer trl`: TRL's GRPOTrainer with its rollouts from the engine (trainer_hooks.trl).

The recipe's keys map onto GRPOConfig; TRL's own logs are forwarded to the recipe's tracker
(JSONL + W&B) under the same names the custom loop uses, so runs of both paths compare.

A chat task's prompts are conversations (tasks/base.py): TRL renders them with the tokenizer's
chat template into the ids rollout/engine/chat.py gives the custom loop. Its reward function scores
each completion's token ids as the custom loop does (Task.score)."""

from __future__ import annotations

import time

from transformers import PrinterCallback, TrainerCallback

from ..run.build import engine_config, frozen_copy
from ..run.config import RecipeConfig, forward_split
from ..run.evaluate import held_out_accuracy
from ..run.shard import engine_slot

# TRL log key -> the custom loop's name for the same quantity.
_ALIASES = {"reward": "reward/mean", "reward_std": "reward/std",
            "completions/mean_length": "completion/mean_length",
            "completions/max_length": "completion/max_length",
            "rollout/generate_seconds": "time/rollout", "rollout/sync_seconds": "time/weight_sync",
            "rollout/wake_seconds": "time/wake", "rollout/sleep_seconds": "time/sleep"}


def grpo_args(cfg: RecipeConfig, accelerator):
    from trl import GRPOConfig

    # RecipeConfig checked that minibatches divides prompts_per_step x num_generations.
    # Read before GRPOConfig: building it resets the accelerate state `accelerator` reads.
    on_cpu = accelerator.device.type == "cpu"
    precision = accelerator.mixed_precision
    per_step = cfg.prompts_per_step * cfg.num_generations // cfg.minibatches
    micro, accumulate = forward_split(per_step, cfg.micro_batch_size)
    return GRPOConfig(
        output_dir=f"{cfg.output_dir}/trl", run_name=cfg.run_name, seed=cfg.seed,
        # Autocast as `accelerate launch --mixed_precision` asked; the engine has its own dtype.
        use_cpu=on_cpu, bf16=precision == "bf16", fp16=precision == "fp16",
        # `steps` counts RL steps (rollouts), as in the custom loop; TRL's max_steps counts
        # optimizer steps, `minibatches` x `epochs` of them per rollout. One log row per RL step.
        max_steps=cfg.steps * _optimizer_steps_per_rollout(cfg),
        num_generations=cfg.num_generations,
        # One generation batch = prompts_per_step prompts x num_generations per process, split
        # into `minibatches` optimizer steps, each reused `epochs` times (num_iterations), each
        # of micro_batch_size sequences a forward/backward (TRL's steps_per_generation counts
        # those, gradient accumulation gathers them into optimizer steps).
        per_device_train_batch_size=micro, gradient_accumulation_steps=accumulate,
        steps_per_generation=cfg.minibatches * accumulate, num_iterations=cfg.epochs,
        max_completion_length=cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p,
        top_k=cfg.top_k, min_p=cfg.min_p or None,
        learning_rate=cfg.learning_rate, lr_scheduler_type="constant",
        weight_decay=cfg.weight_decay, max_grad_norm=cfg.max_grad_norm, beta=cfg.beta,
        epsilon=cfg.clip_eps, logging_steps=_optimizer_steps_per_rollout(cfg),
        save_strategy="no", report_to=[],
        disable_tqdm=not cfg.progress, gradient_checkpointing=cfg.gradient_checkpointing)


def _optimizer_steps_per_rollout(cfg: RecipeConfig) -> int:
    return cfg.minibatches * cfg.epochs


def correctness_reward(task, tokenizer, eos_ids):
    """TRL calls reward functions with the batch's columns as keyword lists and each
    completion's token ids, which the task scores as the custom loop does (Task.score: TRL's
    completion text skips special tokens). `eos_ids`: the ids that end a sample."""

    def correct(completion_ids, answer, **_):
        return [task.score(tokenizer, ids, a, eos_ids) for ids, a in zip(completion_ids, answer)]

    return correct


class _ToTracker(TrainerCallback):
    """Forwards each step's logs, and whether the engine was asleep at every optimizer step;
    every `eval_every` RL steps, the held-out accuracy (`evaluate()`) as eval/accuracy."""

    def __init__(self, tracker, engine, awake_bytes: int, steps_per_rollout: int,
                 evaluate=None, eval_every: int = 0) -> None:
        self.tracker, self.engine, self.awake_bytes = tracker, engine, awake_bytes
        self.steps_per_rollout = steps_per_rollout
        self.evaluate, self.eval_every = evaluate, eval_every
        self.accuracy: tuple[int, float] | None = None  # (RL step, accuracy) of the last eval
        self.asleep: list[bool] = []
        self._step_started = 0.0
        self._step_seconds = 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        self._step_started = time.perf_counter()

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.asleep.append(self.engine.is_sleeping)

    def on_step_end(self, args, state, control, **kwargs):
        self._step_seconds = time.perf_counter() - self._step_started

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not logs or "loss" not in logs:  # the end-of-training summary has no loss
            return
        row = dict(logs)
        row.update({new: logs[old] for old, new in _ALIASES.items() if old in logs})
        rollout = sum(logs.get(k, 0.0) for k in ("rollout/generate_seconds",
                                                  "rollout/sync_seconds",
                                                  "rollout/wake_seconds",
                                                  "rollout/sleep_seconds"))
        row["time/train"] = max(self._step_seconds - rollout, 0.0)
        row["memory/engine_awake_bytes"] = self.awake_bytes
        row["memory/engine_asleep_bytes"] = self.engine.memory_held()
        row["engine/asleep_at_optimizer_step"] = float(bool(self.asleep) and all(self.asleep))
        self.asleep = []
        step = state.global_step // self.steps_per_rollout  # the RL step
        # on_log runs on every rank (TRL gathers the logs first), as the scoring's reduction
        # over the engines needs.
        if self.evaluate is not None and self.eval_every and step % self.eval_every == 0:
            self.accuracy = (step, self.evaluate())
            row["eval/accuracy"] = self.accuracy[1]
            self.tracker.print(f"step {step:4d}  held-out accuracy {self.accuracy[1]:.1%}")
        self.tracker.log(row, step)


def train_trl(cfg: RecipeConfig, accelerator, policy, tokenizer, task, tracker) -> dict:
    from trainer_hooks.colocate import ColocatedRollout
    from trainer_hooks.trl import RolloutGRPOTrainer
    from trainer_hooks.trl_rollout import end_ids

    from .warmstart import warm_start

    out: dict = {}
    if cfg.warmstart_steps:
        # Before TRL wraps the model: every rank trains on the same batches, so the replicas
        # stay equal without a DDP wrapper of our own.
        out["warmstart_loss"] = warm_start(cfg, policy, tokenizer, task, accelerator,
                                           same_batches_on_every_rank=True)
    # Read before GRPOConfig resets the accelerate state.
    slot = engine_slot(accelerator.process_index, accelerator.num_processes,
                       cfg.tensor_parallel_size)
    # The ids samples end on: TRL's eos_token_ids, which the hook stops on alone (filled once
    # the trainer has them; the reward reads them at its first call).
    ends: set[int] = set()
    reward = correctness_reward(task, tokenizer, ends)
    trainer = RolloutGRPOTrainer(
        policy, reward_funcs=[reward], args=grpo_args(cfg, accelerator),
        train_dataset=task.train, processing_class=tokenizer,
        engine_config=engine_config(cfg, slot.index), sleep_level=cfg.sleep_level,
        importance_ratio=cfg.importance_ratio,
        # The KL reference is the policy RL starts from (after the warm start), as in the
        # custom loop; left to TRL it would reload the model's path (none for the tiny model).
        # A PEFT policy's is TRL's own frozen copy of its (warm-started) adapter, "ref";
        # RolloutGRPOTrainer refuses a reference model beside it.
        ref_model=frozen_copy(policy) if cfg.beta > 0 and cfg.lora is None else None)
    ends.update(end_ids(trainer))
    engine = trainer.engine
    engine.wake_up()  # one measured wake: what the engine holds while it generates
    awake_bytes = engine.memory_held()
    engine.sleep(cfg.sleep_level)
    accelerator = trainer.accelerator  # the one TRL built replaces ours (shared state reset)
    # Scoring shares the trainer's engine; it syncs on its own when the weights changed.
    scorer = ColocatedRollout(engine, trainer.model, cfg.sleep_level, synced=False)

    def evaluate() -> float:
        return held_out_accuracy(scorer, task, tokenizer, cfg.max_new_tokens, accelerator)

    to_tracker = _ToTracker(tracker, engine, awake_bytes, _optimizer_steps_per_rollout(cfg),
                            evaluate if task.eval is not None else None, cfg.eval_every)
    trainer.add_callback(to_tracker)
    if not cfg.progress:
        trainer.remove_callback(PrinterCallback)  # it prints every log dict to stdout
    if task.eval is not None:
        out["accuracy_before"] = evaluate()
        tracker.print(f"held-out accuracy before RL: {out['accuracy_before']:.1%}")
    trainer.train()
    if task.eval is not None:
        # The last step's scoring when eval_every landed on it (the same weights).
        last = to_tracker.accuracy
        out["accuracy_after"] = last[1] if last and last[0] == cfg.steps else evaluate()
        tracker.print(f"held-out accuracy after RL: {out['accuracy_after']:.1%}")
    out["engine_stats"] = engine.stats.as_dict()
    return out
