"""Held-out accuracy: greedy completions from the engine, scored by the task's reward.

Each engine scores its own slice of the held-out set and the counts are summed, once per
engine (the k ranks of a tensor-parallel engine score the same slice alike), so the number is
the same whatever the number of processes and engines. A task with an environment is scored on
greedy multi-turn episodes (`held_out_episode_accuracy`)."""

from __future__ import annotations

import torch

from rollout import SamplingParams
from rollout.agent import run_episodes

from .shard import engine_slot, rank_slice


def held_out_accuracy(rollout, task, tokenizer, max_new_tokens: int, accelerator,
                      progress: bool = False) -> float:
    """`rollout`: the run's ColocatedRollout (wakes, syncs weights, sleeps after)."""
    prompts, answers = _rank_share(task, accelerator, rollout.engine)
    correct = 0.0
    if prompts:
        with rollout:
            outs = rollout.generate(task.encode(tokenizer, prompts), SamplingParams(temperature=0,
                                                            max_tokens=max_new_tokens),
                                    use_tqdm=progress and accelerator.is_main_process)
        eos_ids = rollout.engine.eos_ids
        correct = sum(task.score(tokenizer, o.samples[0].token_ids, a, eos_ids)
                      for o, a in zip(outs, answers))
    return _mean_over_engines(correct, len(prompts), accelerator, rollout.engine)


def held_out_episode_accuracy(rollout, task, tokenizer, cfg, accelerator,
                              progress: bool = False) -> float:
    """Greedy episodes with the task's environment (one per held-out prompt), scored by the
    task on each episode's tokens after the prompt."""
    prompts, answers = _rank_share(task, accelerator, rollout.engine)
    correct = 0.0
    if prompts:
        with rollout:
            episodes = _greedy_episodes(rollout, task, tokenizer, cfg, prompts, cfg.max_turns,
                                        progress and accelerator.is_main_process)
        eos_ids = rollout.engine.eos_ids
        correct = sum(task.score(tokenizer, row[0].token_ids, a, eos_ids)
                      for row, a in zip(episodes, answers))
    return _mean_over_engines(correct, len(prompts), accelerator, rollout.engine)


def later_turn_cache(rollout, task, tokenizer, cfg, accelerator, limit: int = 200) -> dict:
    """What the prefix cache serves of later turns, from engine.stats: greedy episodes over (up
    to `limit` of) this rank's held-out prompts, less the same prompts' first turns alone
    (greedy, so the same first turns; the cache is empty after each sleep). Returns the later
    turns' count, prompt tokens (the episode so far, each turn), prompt tokens computed, and
    the environment's tokens in them (a later turn has to compute its observation + 1)."""
    prompts = _rank_share(task, accelerator, rollout.engine)[0][:limit]
    engine, totals = rollout.engine, []
    for max_turns in (1, cfg.max_turns):
        with rollout:
            before = engine.stats.as_dict()  # `stats` is read afresh on each access
            episodes = _greedy_episodes(rollout, task, tokenizer, cfg, prompts, max_turns)
            after = engine.stats.as_dict()
        totals.append((after["prompt_tokens"] - before["prompt_tokens"],
                       after["prompt_tokens_computed"] - before["prompt_tokens_computed"]))
    flat = [row[0] for row in episodes]
    prompt_tokens = totals[1][0] - totals[0][0]
    computed = totals[1][1] - totals[0][1]
    return {"later_turns": sum(ep.turns - 1 for ep in flat), "prompt_tokens": prompt_tokens,
            "computed": computed, "env_tokens": sum(_env_tokens_read(ep) for ep in flat),
            "hit_rate": 1 - computed / prompt_tokens if prompt_tokens else 0.0}


def _greedy_episodes(rollout, task, tokenizer, cfg, prompts, max_turns: int,
                     progress: bool = False):
    """One greedy episode per prompt, turns ending at the task's stop strings; in a `with
    rollout` block."""
    params = SamplingParams(temperature=0, max_tokens=cfg.max_new_tokens,
                            stop=list(task.stop or []))
    return run_episodes(rollout.engine, task.encode(tokenizer, prompts), task.environment,
                        params, max_turns=max_turns, max_episode_tokens=cfg.max_episode_tokens,
                        env_timeout=cfg.env_timeout, use_tqdm=progress)


def _env_tokens_read(episode) -> int:
    """Environment tokens followed by a model turn (the ones a later turn computes); an
    episode's last observation may end it unread."""
    last_model = max((i for i, m in enumerate(episode.mask) if m), default=-1)
    return sum(1 for m in episode.mask[:last_model] if not m)


def _slot(accelerator, engine):
    return engine_slot(accelerator.process_index, accelerator.num_processes, engine.tp.size)


def _rank_share(task, accelerator, engine) -> tuple[list, list[str]]:
    """This rank's engine's slice of the held-out prompts and answers."""
    slot = _slot(accelerator, engine)
    return (rank_slice(task.eval["prompt"], slot.index, slot.count),
            rank_slice(task.eval["answer"], slot.index, slot.count))


def _mean_over_engines(correct: float, count: int, accelerator, engine) -> float:
    if _slot(accelerator, engine).tp_rank:  # the engine's rank 0 counts for all its ranks
        correct, count = 0.0, 0
    totals = torch.tensor([correct, float(count)], device=accelerator.device)
    totals = accelerator.reduce(totals, reduction="sum")
    return float(totals[0] / totals[1])
