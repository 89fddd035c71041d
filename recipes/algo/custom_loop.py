"""The custom trainer: a minimal GRPO / PPO loop on the rollout engine, for people who write
their own. One step:

    with rollout:                    wake the engine, sync changed weights, generate n samples
        outs = rollout.generate()    per prompt (prompt KV shared in the radix tree)
                                     (leaving the block puts the engine to sleep)
    rewards -> advantages            group-normalised (grpo) or GAE on a value head (ppo)
    loss / backward / step           importance ratio against the engine's logprobs

A task with an environment (Task.environment: a tool, a game) rolls out multi-turn episodes
instead (rollout.agent.run_episodes: n episodes per prompt, each turn's prompt the episode so
far, served by the radix cache) and trains on their mask, built once in batch.py: the loss, the
KL and PPO's value loss count model tokens only, the environment's tokens are context; the
engine's logprobs are the behaviour policy at model tokens; GRPO normalises episode rewards
within a prompt's n episodes, PPO runs GAE over model tokens with the environment's skipped
(advantages.episode_gae). The single-turn path is unchanged.

Partial rollouts and dynamic sampling (partial.py) draw a step's groups with Engine.rollout;
the loss is then decoupled (losses.py): clipped against the policy at the start of the step,
recomputed here, each token weighted by it over the engine's logprob from the weights that
sampled the token. So is the loss of tokens drawn from a truncated distribution that the
trainer's untruncated policy is compared with (importance_ratio "full_policy", episodes).
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
import time

import torch
from tqdm.auto import tqdm

from rollout import SamplingParams
from rollout.agent import run_episodes
from trainer_hooks.colocate import ColocatedRollout

from ..run.config import RecipeConfig
from ..run.rollout_metrics import EngineMeter
from ..run.shard import PromptSampler, engine_slot
from .advantages import episode_gae, gae, group_advantages, whiten
from .batch import RolloutBatch, build_batch, build_episode_batch
from .logprobs import policy_logprobs, token_logprobs
from .losses import grpo_loss, mismatch_stats, ppo_loss
from .partial import GroupDrawer, behaviour_weight_stats, decouple
from .routing_replay import FlipCount, moe_routers, routed_expert_batch, routing_replay
from .update_metrics import extreme, groups_with_signal, ratio_metrics, reduce_stat


class CustomTrainer:
    def __init__(self, cfg: RecipeConfig, accelerator, module, optimizer, rollout:
                 ColocatedRollout, tokenizer, task, tracker, ref_model=None) -> None:
        self.cfg, self.acc, self.module, self.optimizer = cfg, accelerator, module, optimizer
        self.rollout, self.engine, self.tokenizer = rollout, rollout.engine, tokenizer
        self.task, self.tracker, self.ref = task, tracker, ref_model
        self.meter = EngineMeter(self.engine)
        # Everything below is seeded per engine, not per process: the k ranks of a
        # tensor-parallel engine must run the same requests with the same seeds. They then also
        # train on the same batch in the same order, replicas of one data-parallel worker: DDP
        # averages k equal gradients per engine, so the update is that of W / k data-parallel
        # workers. Splitting the batch across them instead would save training compute but
        # change every per-rank normalisation (tokens per minibatch, PPO's whitening, GRPO's
        # groups) and leave ranks with empty minibatches.
        slot = engine_slot(accelerator.process_index, accelerator.num_processes,
                           cfg.tensor_parallel_size)
        self.sampler = PromptSampler(len(task.train), cfg.prompts_per_step, slot.index,
                                     slot.count, cfg.seed)
        # Seeds differ per engine (engine seed) and per request, so samples are independent.
        self.params = SamplingParams(n=cfg.num_generations, temperature=cfg.temperature,
                                     top_p=cfg.top_p, top_k=cfg.top_k, min_p=cfg.min_p,
                                     max_tokens=cfg.max_new_tokens, logprobs=True)
        self.generator = torch.Generator().manual_seed(cfg.seed + slot.index)
        self.episodic = task.environment is not None
        # The behaviour logprobs the batch keeps (batch.py build_batch): the sampled
        # distribution's where the sampler truncates, with its supports for "on_support".
        self.behaviour = "logprobs"
        if cfg.truncates:
            on_support = cfg.importance_ratio == "on_support" and not self.episodic
            self.behaviour = "on_support" if on_support else "sampling"
            self.params = dataclasses.replace(self.params, return_support=on_support)
        # The decoupled objective (partial.py) where the engine's logprobs are not the trainer's
        # policy at the step's start: tokens sampled by older weights (partial rollouts), or
        # drawn from a truncated distribution the trainer's untruncated side is compared with
        # (full_policy, episodes). Clipped against mu, pi / mu would start below 1 by the mass
        # the filter cut, and a negative-advantage token whose cut passes clip_eps would get no
        # gradient at all; clipped against the trainer's own policy, with pi_prox / mu as each
        # token's weight, both signs are weighed alike.
        self.decoupled = cfg.partial_rollouts or self.behaviour == "sampling"
        if self.episodic:
            # Turns end at the task's stop strings (a tool call's end tag). run_episodes seeds
            # each turn from params.seed, so draw one per step, per engine: left to
            # run_episodes, it would come from the global `random`, seeded alike on every rank.
            self.episode_params = dataclasses.replace(self.params, stop=list(task.stop or []))
            self.episode_seeds = random.Random(cfg.seed * 7907 + slot.index)
        self._awake_steps = 0  # this step's optimizer steps taken while the engine was awake
        self._optimizer_steps = 0
        # MoE policies: the engine returns each sample's experts, so every step logs
        # moe/routing_flip_rate, and cfg.routing_replay forces them (_replay). Not for episodes:
        # an Episode keeps no routes for its turns.
        self.routes = None
        if not self.episodic and moe_routers(module):
            self.params = dataclasses.replace(self.params, return_routed_experts=True)
        self.drawer = None
        if cfg.partial_rollouts or cfg.dynamic_sampling:
            self.drawer = GroupDrawer(cfg, rollout, task, tokenizer, self.sampler, self.params)

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
        self.flips = FlipCount()
        self.meter.start()
        t0 = time.perf_counter()
        episodes, episode_metrics, rewards = None, {}, None
        with self.rollout:
            mem_awake = self.engine.memory_held()
            t_gen = time.perf_counter()
            if self.drawer is not None:
                outs, rewards, episode_metrics = self.drawer.draw()
            else:
                rows = self.task.train[self.sampler.next()]
                prompts, answers = rows["prompt"], rows["answer"]
                if self.episodic:
                    episodes = self._run_episodes(self.task.encode(self.tokenizer, prompts))
                else:
                    outs = self.rollout.generate(self.task.encode(self.tokenizer, prompts),
                                                 self.params)
            gen_seconds = time.perf_counter() - t_gen
        rollout_seconds = time.perf_counter() - t0
        mem_asleep = self.engine.memory_held()
        if episodes is not None:
            batch, episode_metrics = self._episode_batch(episodes, answers)
        else:
            if rewards is None:
                rewards = [self.task.score(self.tokenizer, s.token_ids, answer,
                                           self.engine.eos_ids)
                           for out, answer in zip(outs, answers) for s in out.samples]
            batch = build_batch(outs, rewards, self.tokenizer.pad_token_id, self.acc.device,
                                self.behaviour)
            if self.params.return_routed_experts:
                self.routes = routed_expert_batch(outs, batch.input_ids.shape[1], self.module,
                                                  self.engine.weights_version, self.acc.device)
        t1 = time.perf_counter()
        if self.decoupled:
            self._decouple(batch)
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
            **episode_metrics,
            **update,
            **({"moe/routing_flip_rate": self.flips.rate} if self.params.return_routed_experts
               else {}),
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
            # The weights the rollout came from (every sync is verified: a bad one raises).
            "weights/version": self.engine.weights_version,
        }

    # --- multi-turn episodes -----------------------------------------------------------------
    def _run_episodes(self, prompt_ids: list[list[int]]):
        params = dataclasses.replace(self.episode_params,
                                     seed=self.episode_seeds.getrandbits(63))
        return run_episodes(self.engine, prompt_ids, self.task.environment, params,
                            max_turns=self.cfg.max_turns,
                            max_episode_tokens=self.cfg.max_episode_tokens,
                            env_timeout=self.cfg.env_timeout)

    def _episode_batch(self, episodes, answers) -> tuple[RolloutBatch, dict]:
        """Each episode scored by the task on its tokens after the prompt; the batch's mask is
        the episodes' own (model tokens 1, environment tokens 0)."""
        rewards = [self.task.score(self.tokenizer, ep.token_ids, answer, self.engine.eos_ids)
                   for row, answer in zip(episodes, answers) for ep in row]
        batch = build_episode_batch(episodes, rewards, self.tokenizer.pad_token_id,
                                    self.acc.device, self.behaviour)
        flat = [ep for row in episodes for ep in row]
        count = len(flat)
        return batch, {
            "episode/turns": sum(ep.turns for ep in flat) / count,
            "episode/length": sum(len(ep.token_ids) for ep in flat) / count,
            "episode/env_tokens": sum(len(ep.mask) - sum(ep.mask) for ep in flat) / count,
            "episode/done": sum(ep.finish_reason == "done" for ep in flat) / count,
            "episode/aborted": sum(ep.finish_reason == "abort" for ep in flat) / count,
        }

    # --- updates ----------------------------------------------------------------------------
    def grpo_update(self, batch: RolloutBatch) -> dict:
        advantages = group_advantages(batch.rewards, batch.group)
        ref_logprobs = self._reference_logprobs(batch) if self.cfg.beta > 0 else None
        totals: dict[str, float] = {}

        def loss_fn(index, rows, num_tokens):
            logprobs = policy_logprobs(self.module, rows["input_ids"], rows["attention_mask"],
                                       self.cfg.temperature, rows.get("keep"))
            ref = ref_logprobs[index] if ref_logprobs is not None else None
            weights, weight_stats = behaviour_weight_stats(rows, self.cfg.behaviour_weight_cap)
            loss, stats = grpo_loss(logprobs, rows["old_logprobs"], advantages[index],
                                    rows["mask"], num_tokens, self.cfg.clip_eps, ref,
                                    self.cfg.beta, weights)
            return loss, stats | weight_stats | self._mismatch(logprobs, rows)

        tokens = self._optimise(batch, loss_fn, totals)
        out = {**ratio_metrics(totals, tokens), "loss/loss": totals["loss"],
               "reward/groups_with_signal": groups_with_signal(batch)}
        if "kl" in totals:
            out["kl"] = totals["kl"] / tokens
        return out

    def ppo_update(self, batch: RolloutBatch) -> dict:
        with torch.no_grad():
            old_values = self._chunked(batch, lambda rows: self.module(
                input_ids=rows["input_ids"], attention_mask=rows["attention_mask"])[1][:, :-1],
                replayed=True)
        token_rewards = torch.zeros_like(batch.mask)
        last = (batch.mask * torch.arange(batch.mask.shape[1], device=batch.mask.device)).argmax(1)
        token_rewards[torch.arange(batch.size), last] = batch.rewards
        out: dict[str, float] = {}
        if self.cfg.beta > 0:  # per-token KL penalty folded into the reward, as in RLHF PPO
            # old_logprobs are on the reference's support: untruncated, renormalised over the
            # kept tokens as the reference's are (on_support), or the proximal policy's (a
            # decoupled batch: a truncated mu would add log(1 / kept mass) to every token's KL)
            kl = (batch.old_logprobs - self._reference_logprobs(batch)) * batch.mask
            token_rewards = token_rewards - self.cfg.beta * kl
            out["kl"] = (kl.sum() / batch.mask.sum()).item()
        # Episodes: GAE over model tokens, the environment's skipped (not time steps).
        advantages, returns = (episode_gae if batch.episodic else gae)(
            token_rewards, old_values, batch.mask, self.cfg.gamma, self.cfg.lam)
        advantages = whiten(advantages, batch.mask)
        totals: dict[str, float] = {}

        def loss_fn(index, rows, num_tokens):
            logits, values = self.module(input_ids=rows["input_ids"],
                                         attention_mask=rows["attention_mask"])
            logprobs = token_logprobs(logits, rows["input_ids"], self.cfg.temperature,
                                      rows.get("keep"))
            weights, weight_stats = behaviour_weight_stats(rows, self.cfg.behaviour_weight_cap)
            loss, stats = ppo_loss(logprobs, rows["old_logprobs"], values[:, :-1],
                                   old_values[index], returns[index], advantages[index],
                                   rows["mask"], num_tokens, self.cfg.clip_eps,
                                   self.cfg.value_clip, self.cfg.vf_coef, weights)
            return loss, stats | weight_stats | self._mismatch(logprobs, rows)

        tokens = self._optimise(batch, loss_fn, totals)
        return out | {"loss/policy": totals["policy_loss"] / tokens,
                      "loss/value": totals["value_loss"] / tokens,
                      **ratio_metrics(totals, tokens), "loss/loss": totals["loss"],
                      "value/mean": ((old_values * batch.mask).sum() / batch.mask.sum()).item()}

    def _optimise(self, batch: RolloutBatch, loss_fn, totals: dict) -> float:
        """epochs x minibatches optimizer steps; each minibatch in micro-batches whose
        gradients add up (DDP all-reduces only on the last one). Returns tokens seen."""
        seen, losses = 0.0, []
        self._first_minibatch = True
        for _ in range(self.cfg.epochs):
            order = torch.randperm(batch.size, generator=self.generator).to(self.acc.device)
            # tensor_split: exactly `minibatches` parts (chunk gives fewer when they do not
            # divide the batch: 6 in 4 -> 3); the config keeps each non-empty.
            for mini in order.tensor_split(self.cfg.minibatches):
                local = batch.mask[mini].sum()
                num_tokens = self._tokens_per_rank(local)
                # A minibatch of no trained tokens (episodes aborted before their first turn)
                # sums to 0: over 1, not 0, whose NaN the step would write into every weight.
                num_tokens = torch.where(num_tokens > 0, num_tokens, torch.ones_like(num_tokens))
                micro = mini.split(self.cfg.micro_batch_size)
                minibatch_loss = 0.0
                for k, index in enumerate(micro):
                    sync = k == len(micro) - 1
                    # backward too under the replay: a checkpointed recompute must route alike
                    with (contextlib.nullcontext() if sync else self.acc.no_sync(self.module),
                          self._replay(index)):
                        loss, stats = loss_fn(index, batch.rows(index), num_tokens)
                        self.acc.backward(loss)
                    minibatch_loss += loss.item()
                    for key, value in stats.items():
                        totals[key] = reduce_stat(key, totals.get(key), float(value.detach()))
                if self._first_minibatch:
                    totals["mismatch/tokens"] = local.item()
                losses.append(minibatch_loss)
                seen += local.item()
                self._optimizer_step()
                self._first_minibatch = False
        totals["loss"] = sum(losses) / len(losses)
        return seen

    def _tokens_per_rank(self, local: torch.Tensor) -> torch.Tensor:
        """What each rank divides its token sum by: the mean over ranks of their minibatch's
        tokens. DDP averages the ranks' gradients, so the update is then the per-token mean over
        every engine's samples (a rank's own count would weigh a token on a rank of short
        completions above one on a rank of long ones). The k ranks of a tensor-parallel engine
        hold the same samples and count k times, in the numerator as here."""
        if self.acc.num_processes == 1:
            return local
        return self.acc.reduce(local.to(torch.float64), reduction="mean").to(local.dtype)

    def _optimizer_step(self) -> None:
        # Colocation's promise: the engine's KV pool is freed before the optimizer allocates.
        self._optimizer_steps += 1
        if not self.engine.is_sleeping:
            self._awake_steps += 1
        if self.cfg.max_grad_norm > 0:
            self.acc.clip_grad_norm_(self.module.parameters(), self.cfg.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def _decouple(self, batch: RolloutBatch) -> None:
        """The decoupled objective's proximal policy (partial.py): the trainer's logprobs now,
        before this step's first optimizer step."""
        def proximal(rows):
            if self.cfg.algo == "ppo":  # the value-head model returns (logits, values)
                logits = self.module(input_ids=rows["input_ids"],
                                     attention_mask=rows["attention_mask"])[0]
                return token_logprobs(logits, rows["input_ids"], self.cfg.temperature,
                                      rows.get("keep"))
            return policy_logprobs(self.module, rows["input_ids"], rows["attention_mask"],
                                   self.cfg.temperature, rows.get("keep"))

        self.module.eval()
        with torch.no_grad():
            decouple(batch, self._chunked(batch, proximal, replayed=True))

    def _mismatch(self, logprobs, rows) -> dict:
        """The rollout-vs-trainer statistics of the first minibatch (the trainer's policy is
        still the one at the step's start; a carried token's behaviour policy is older): keys
        "mismatch/...", reduced by reduce_stat."""
        if not self._first_minibatch:
            return {}
        behaviour = rows.get("behaviour_logprobs", rows["old_logprobs"])
        stats = mismatch_stats(logprobs, behaviour, rows["mask"])
        return {f"mismatch/{key}": value for key, value in stats.items()}

    # --- helpers ----------------------------------------------------------------------------
    def _replay(self, index: torch.Tensor):
        """A micro-batch's routing replay (forced when cfg.routing_replay; its flips counted in
        self.flips either way); nothing for a dense policy or episodes."""
        if self.routes is None:
            return contextlib.nullcontext()
        return routing_replay(self.module, self.routes[index], self.cfg.routing_replay,
                              self.flips)

    def _reference_logprobs(self, batch: RolloutBatch) -> torch.Tensor:
        with torch.no_grad():
            # On the same support as the policy's, so the KL compares like with like.
            return self._chunked(batch, lambda rows: policy_logprobs(
                self.ref, rows["input_ids"], rows["attention_mask"], self.cfg.temperature,
                rows.get("keep")))

    def _chunked(self, batch: RolloutBatch, fn, replayed: bool = False) -> torch.Tensor:
        """fn over the batch's rows a micro-batch at a time; `replayed`: the policy's forwards
        routed as the loss's are (cfg.routing_replay), so the proximal policy and the old
        values are those of the policy the loss then computes (a plain forward's routing
        can differ: pi / pi_prox would not start at 1). Its flips are not counted again."""
        index = torch.arange(batch.size, device=self.acc.device)
        forced = replayed and self.routes is not None and self.cfg.routing_replay
        out = []
        for i in index.split(self.cfg.micro_batch_size):
            with routing_replay(self.module, self.routes[i], True, FlipCount()) if forced \
                    else contextlib.nullcontext():
                out.append(fn(batch.rows(i)))
        return torch.cat(out)

    def _mean_over_ranks(self, metrics: dict) -> dict:
        """Each engine's k ranks count alike (k times each), so this is the mean over engines."""
        if self.acc.num_processes == 1:
            return metrics
        keys = sorted(metrics)
        values = torch.tensor([float(metrics[k]) for k in keys], device=self.acc.device,
                              dtype=torch.float64)
        # Extremes stay extremes (a broken sync on one rank must not be halved in the log); a
        # step counts as asleep only if every rank was asleep.
        lowest = [extreme(k) == "min" or k == "engine/asleep_at_optimizer_step" for k in keys]
        highest = [extreme(k) == "max" for k in keys]
        per_rank = self.acc.gather(values.unsqueeze(0))  # [ranks, keys]
        out = per_rank.mean(0)
        out = torch.where(torch.tensor(lowest, device=out.device), per_rank.min(0).values, out)
        out = torch.where(torch.tensor(highest, device=out.device), per_rank.max(0).values, out)
        return dict(zip(keys, out.tolist()))
