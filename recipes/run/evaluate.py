"""Held-out accuracy: greedy completions from the engine, scored by the task's reward.

Each rank scores its own slice of the held-out set and the counts are summed, so the number is
the same whatever the number of processes."""

from __future__ import annotations

import torch

from rollout import SamplingParams

from .shard import rank_slice


def held_out_accuracy(rollout, task, tokenizer, max_new_tokens: int, accelerator,
                      progress: bool = False) -> float:
    """`rollout`: the run's ColocatedRollout (wakes, syncs weights, sleeps after)."""
    held_out, reward = task.eval, task.reward
    rank, world = accelerator.process_index, accelerator.num_processes
    prompts = rank_slice(held_out["prompt"], rank, world)
    answers = rank_slice(held_out["answer"], rank, world)
    correct = 0.0
    if prompts:
        with rollout:
            outs = rollout.generate(task.encode(tokenizer, prompts), SamplingParams(temperature=0,
                                                            max_tokens=max_new_tokens),
                                    use_tqdm=progress and accelerator.is_main_process)
        correct = sum(reward(o.samples[0].text or "", a) for o, a in zip(outs, answers))
    totals = torch.tensor([correct, float(len(prompts))], device=accelerator.device)
    totals = accelerator.reduce(totals, reduction="sum")
    return float(totals[0] / totals[1])
