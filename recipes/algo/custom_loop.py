"""The custom trainer: a minimal GRPO / PPO loop on the rollout engine, for people who write
their own. One step:

    with rollout:                    wake the engine, sync changed weights, generate n samples
        outs = rollout.generate()    per prompt (prompt KV shared in the radix tree)
                                     (leaving the block puts the engine to sleep)
    rewards -> advantages            group-normalised (grpo) or GAE on a value head (ppo)
    loss / backward / step           importance ratio against the engine's logprobs
"""

from __future__ import annotations

import contextlib
import time

import torch
from tqdm.auto import tqdm

from rollout import SamplingParams
from trainer_hooks.colocate import ColocatedRollout

from ..run.config import RecipeConfig
from ..run.rollout_metrics import EngineMeter
from ..run.shard import PromptSampler
from .advantages import gae, group_advantages, whiten
from .batch import RolloutBatch, build_batch
from .logprobs import policy_logprobs, token_logprobs
from .losses import grpo_loss, ppo_loss


class CustomTrainer:
    def __init__(self, cfg: RecipeConfig, accelerator, module, optimizer, rollout:
                 ColocatedRollout, tokenizer, task, tracker, ref_model=None) -> None:
        self.cfg, self.acc, self.module, self.optimizer = cfg, accelerator, module, optimizer
        self.rollout, self.engine, self.tokenizer = rollout, rollout.engine, tokenizer
        self.task, self.tracker, self.ref = task, tracker, ref_model
        self.meter = EngineMeter(self.engine)
        self.sampler = PromptSampler(len(task.train), cfg.prompts_per_step,
                                     accelerator.process_index, accelerator.num_processes,
                                     cfg.seed)
        # Seeds differ per rank (engine seed) and per request, so samples are independent.
        self.params = SamplingParams(n=cfg.num_generations, temperature=cfg.temperature,
                                     max_tokens=cfg.max_new_tokens, logprobs=True)
        self.generator = torch.Generator().manual_seed(cfg.seed + accelerator.process_index)
        self._awake_steps = 0  # this step's optimizer steps taken while the engine was awake
        self._optimizer_steps = 0

    # --- one RL step ------------------------------------------------------------------------
    def train(self, evaluate=None) -> float | None:
        """`evaluate()` -> held-out accuracy, run every `eval_every` steps and after the last
        one, logged as eval/accuracy; returns the last value."""
        bar = tqdm(range(1, self.cfg.steps + 1), desc=f"{self.cfg.algo} (custom loop)",
                   unit="step", disable=not (self.cfg.progress and self.acc.is_main_process))
        accuracy = None
        for step in bar:
            metrics = self._mean_over_ranks(self.step())
            every = self.cfg.eval_every
            if evaluate is not None and (step == self.cfg.steps or every and step % every == 0):
                accuracy = metrics["eval/accuracy"] = evaluate()
            self.tracker.log(metrics, step)
            bar.set_postfix(reward=f"{metrics['reward/mean']:.3f}")
            line = (f"step {step:4d}  reward {metrics['reward/mean']:.3f}  "
                    f"len {metrics['completion/mean_length']:.1f}  "
                    f"rollout {metrics['rollout/tokens_per_second']:.0f} tok/s")
            if "eval/accuracy" in metrics:
                line += f"  held-out accuracy {metrics['eval/accuracy']:.1%}"
            self.tracker.print(line)
        return accuracy

    def step(self) -> dict:
        self._awake_steps = self._optimizer_steps = 0
        rows = self.task.train[self.sampler.next()]
        prompts, answers = rows["prompt"], rows["answer"]
        self.meter.start()
        t0 = time.perf_counter()
        with self.rollout:
            mem_awake = self.engine.memory_held()
            t_gen = time.perf_counter()
            outs = self.rollout.generate(self.task.encode(self.tokenizer, prompts), self.params)
            gen_seconds = time.perf_counter() - t_gen
        rollout_seconds = time.perf_counter() - t0
        mem_asleep = self.engine.memory_held()
        rewards = [self.task.reward(s.text or "", answer)
                   for out, answer in zip(outs, answers) for s in out.samples]
        batch = build_batch(outs, rewards, self.tokenizer.pad_token_id, self.acc.device)
        t1 = time.perf_counter()
        self.module.train()
        update = self.grpo_update(batch) if self.cfg.algo == "grpo" else self.ppo_update(batch)
        train_seconds = time.perf_counter() - t1
        timings = self.rollout.timings
        lengths = batch.completion_lengths
        return {
            "reward/mean": batch.rewards.mean().item(),
            "reward/std": batch.rewards.std().item() if batch.size > 1 else 0.0,
            "completion/mean_length": lengths.mean().item(),
            "completion/max_length": lengths.max().item(),
            **update,
            **self.meter.finish(gen_seconds),
            "time/rollout": gen_seconds,
            "time/weight_sync": timings.get("sync", 0.0),
            "time/wake": timings.get("wake", 0.0),
            "time/sleep": timings.get("sleep", 0.0),
            "time/rollout_total": rollout_seconds,
            "time/train": train_seconds,
            "memory/engine_awake_bytes": mem_awake,
            "memory/engine_asleep_bytes": mem_asleep,
            "engine/asleep_at_optimizer_step": float(self._awake_steps == 0
                                                     and self._optimizer_steps > 0),
            "engine/optimizer_steps": self._optimizer_steps,
        }

    # --- updates ----------------------------------------------------------------------------
    def grpo_update(self, batch: RolloutBatch) -> dict:
        advantages = group_advantages(batch.rewards, batch.group)
        ref_logprobs = self._reference_logprobs(batch) if self.cfg.beta > 0 else None
        totals: dict[str, float] = {}

        def loss_fn(index, rows, num_tokens):
            logprobs = policy_logprobs(self.module, rows["input_ids"], rows["attention_mask"],
                                       self.cfg.temperature)
            ref = ref_logprobs[index] if ref_logprobs is not None else None
            return grpo_loss(logprobs, rows["old_logprobs"], advantages[index], rows["mask"],
                             num_tokens, self.cfg.clip_eps, ref, self.cfg.beta)

        tokens = self._optimise(batch, loss_fn, totals)
        out = {**_ratio_metrics(totals, tokens), "loss/loss": totals["loss"],
               "reward/groups_with_signal": _groups_with_signal(batch)}
        if "kl" in totals:
            out["kl"] = totals["kl"] / tokens
        return out

    def ppo_update(self, batch: RolloutBatch) -> dict:
        with torch.no_grad():
            old_values = self._chunked(batch, lambda rows: self.module(
                input_ids=rows["input_ids"], attention_mask=rows["attention_mask"])[1][:, :-1])
        token_rewards = torch.zeros_like(batch.mask)
        last = (batch.mask * torch.arange(batch.mask.shape[1], device=batch.mask.device)).argmax(1)
        token_rewards[torch.arange(batch.size), last] = batch.rewards
        out: dict[str, float] = {}
        if self.cfg.beta > 0:  # per-token KL penalty folded into the reward, as in RLHF PPO
            kl = (batch.old_logprobs - self._reference_logprobs(batch)) * batch.mask
            token_rewards = token_rewards - self.cfg.beta * kl
            out["kl"] = (kl.sum() / batch.mask.sum()).item()
        advantages, returns = gae(token_rewards, old_values, batch.mask, self.cfg.gamma,
                                  self.cfg.lam)
        advantages = whiten(advantages, batch.mask)
        totals: dict[str, float] = {}

        def loss_fn(index, rows, num_tokens):
            logits, values = self.module(input_ids=rows["input_ids"],
                                         attention_mask=rows["attention_mask"])
            logprobs = token_logprobs(logits, rows["input_ids"], self.cfg.temperature)
            return ppo_loss(logprobs, rows["old_logprobs"], values[:, :-1], old_values[index],
                            returns[index], advantages[index], rows["mask"], num_tokens,
                            self.cfg.clip_eps, self.cfg.value_clip, self.cfg.vf_coef)

        tokens = self._optimise(batch, loss_fn, totals)
        return out | {"loss/policy": totals["policy_loss"] / tokens,
                      "loss/value": totals["value_loss"] / tokens,
                      **_ratio_metrics(totals, tokens), "loss/loss": totals["loss"],
                      "value/mean": ((old_values * batch.mask).sum() / batch.mask.sum()).item()}

    def _optimise(self, batch: RolloutBatch, loss_fn, totals: dict) -> float:
        """epochs x minibatches optimizer steps; each minibatch in micro-batches whose
        gradients add up (DDP all-reduces only on the last one). Returns tokens seen."""
        seen, losses = 0.0, []
        for _ in range(self.cfg.epochs):
            order = torch.randperm(batch.size, generator=self.generator).to(self.acc.device)
            for mini in order.chunk(self.cfg.minibatches):
                num_tokens = batch.mask[mini].sum()
                micro = mini.split(self.cfg.micro_batch_size)
                minibatch_loss = 0.0
                for k, index in enumerate(micro):
                    sync = k == len(micro) - 1
                    with contextlib.nullcontext() if sync else self.acc.no_sync(self.module):
                        loss, stats = loss_fn(index, batch.rows(index), num_tokens)
                        self.acc.backward(loss)
                    minibatch_loss += loss.item()
                    for key, value in stats.items():
                        totals[key] = totals.get(key, 0.0) + float(value.detach())
                losses.append(minibatch_loss)
                seen += num_tokens.item()
                self._optimizer_step()
        totals["loss"] = sum(losses) / len(losses)
        return seen

    def _optimizer_step(self) -> None:
        # Colocation's promise: the engine's KV pool is freed before the optimizer allocates.
        self._optimizer_steps += 1
        if not self.engine.is_sleeping:
            self._awake_steps += 1
        if self.cfg.max_grad_norm > 0:
            self.acc.clip_grad_norm_(self.module.parameters(), self.cfg.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    # --- helpers ----------------------------------------------------------------------------
    def _reference_logprobs(self, batch: RolloutBatch) -> torch.Tensor:
        with torch.no_grad():
            return self._chunked(batch, lambda rows: policy_logprobs(
                self.ref, rows["input_ids"], rows["attention_mask"], self.cfg.temperature))

    def _chunked(self, batch: RolloutBatch, fn) -> torch.Tensor:
        index = torch.arange(batch.size, device=self.acc.device)
        return torch.cat([fn(batch.rows(i)) for i in index.split(self.cfg.micro_batch_size)])

    def _mean_over_ranks(self, metrics: dict) -> dict:
        if self.acc.num_processes == 1:
            return metrics
        keys = sorted(metrics)
        values = torch.tensor([float(metrics[k]) for k in keys], device=self.acc.device,
                              dtype=torch.float64)
        values = self.acc.reduce(values, reduction="mean")
        out = dict(zip(keys, values.tolist()))
        # A step counts as asleep only if every rank was asleep.
        flags = torch.tensor([metrics["engine/asleep_at_optimizer_step"]],
                             device=self.acc.device)
        out["engine/asleep_at_optimizer_step"] = float(self.acc.gather(flags).min())
        return out


def _ratio_metrics(totals: dict, tokens: float) -> dict:
    return {"loss/clip_frac": totals["clip_frac"] / tokens, "loss/ratio": totals["ratio"] / tokens,
            "loss/ratio_abs_dev": totals["ratio_abs_dev"] / tokens}


def _groups_with_signal(batch: RolloutBatch) -> float:
    """Share of prompts whose samples got different rewards: only those move a GRPO step."""
    groups = batch.group.unique()
    mixed = [batch.rewards[batch.group == g].std() > 0 for g in groups]
    return sum(bool(m) for m in mixed) / len(groups)
