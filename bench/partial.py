"""The tail of a GRPO step: synchronous generate() against partial rollouts, same workload, same
run, on SmolLM2-135M-Instruct (recipes/run/smollm2.py) in fp32. Not in CI.

Each of `--steps` training steps needs B complete groups of n samples (chat prompts sharing
bench/peers.py's ~280-token system prompt, temperature 1, EOS honoured, up to `--max-tokens`
new tokens, which some answers reach). Between steps the engine sleeps, wakes and takes new
weights by update_weights (every weight moved by a small random step: a real change, so carried
groups re-prefill under weights they were not started on; what the optimizer would compute does
not change the rollout's cost).

- sync: `generate(B prompts)`: the step ends with its longest sample.
- partial: `rollout(prompts, groups=B)` with `--over-sample` x B groups in flight (new prompts
  top up what is carried) and `max_staleness` = `--staleness`: the step ends at the B-th
  complete group; the others go on in the next step.

The two systems are separate engines on the same weights, run step by step interleaved (the
machine is shared and noisy). Reported: rollout seconds per step (only the generate/rollout
calls), samples trained per rollout second and the ratio partial/sync (the goal is >= 1.5),
engine steps per training step, tokens generated per token trained (tokens of restarted samples
and of groups still carried at the end count as generated), the histogram of completion
lengths, and how stale the trained samples' oldest tokens are.

`--exact` measures instead how often carrying changes a token: the same seeded requests, run
uninterrupted by one engine and by another that returns half of them, sleeps (level 2), takes
the same weights back and finishes the rest (re-prefilling what it had decoded); it counts the
carried samples whose tokens differ from the uninterrupted run's, and where they first differ.

    python bench/partial.py [--steps 6] [--groups 8] [--n 8] [--max-tokens 128] [--threads 2]
    python bench/partial.py --exact [--groups 16]
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from peers import SYSTEM, questions, render  # noqa: E402
from workloads import cpu_name  # noqa: E402


def perturb(model, step: int, scale: float) -> None:
    """A small random step on every weight (the trainer's update, as far as the engine sees)."""
    gen = torch.Generator().manual_seed(step)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale * p.abs().mean())


class Run:
    """One system's run: its engine, what it trained on and what it cost."""

    def __init__(self, name: str, engine, args) -> None:
        self.name, self.engine, self.args = name, engine, args
        self.seconds: list[float] = []
        self.trained: list = []  # samples handed to the trainer
        self.staleness = collections.Counter()
        self.generated_before = self.steps_before = 0  # the warm-up's tokens and steps

    def step(self, prompts: list[list[int]], params) -> None:
        e, args = self.engine, self.args
        t0 = time.perf_counter()
        if self.name == "sync":
            outs = e.generate(prompts, params)
        else:
            outs = e.rollout(prompts, params, groups=args.groups)
        self.seconds.append(time.perf_counter() - t0)
        for o in outs:
            for s in o.samples:
                self.trained.append(s)
                self.staleness[e.weights_version - s.weights_versions[0]
                               if s.weights_versions else 0] += 1

    def new_prompts(self) -> int:
        """How many new prompts the next call takes."""
        if self.name == "sync":
            return self.args.groups
        return max(0, round(self.args.over_sample * self.args.groups) - len(self.engine.carried))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--groups", type=int, default=8, help="B: groups trained per step")
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--over-sample", type=float, default=1.5)
    ap.add_argument("--staleness", type=int, default=1)
    ap.add_argument("--update-scale", type=float, default=1e-3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--exact", action="store_true", help="count tokens carrying changes")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from rollout import Engine, EngineConfig, SamplingParams
    from rollout_recipes.run import smollm2

    reason = smollm2.missing()
    if reason:
        raise SystemExit(reason)
    model, tok = smollm2.load()
    config = EngineConfig(max_model_len=1024, max_num_seqs=256, seed=0, keep_cpu_heap=True,
                          max_staleness=args.staleness)
    runs = [Run("sync", Engine(model, config, tokenizer=tok), args),
            Run("partial", Engine(model, config, tokenizer=tok), args)]
    params = SamplingParams(n=args.n, temperature=1.0, max_tokens=args.max_tokens)
    if args.exact:
        return exactness(runs[0].engine, runs[1].engine, model, tok, args)
    warm = [render(tok, [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": q}]) for q in questions(2, 999)]
    for run in runs:
        run.engine.generate(warm, params)
        run.generated_before = run.engine.stats.generated_tokens
        run.steps_before = run.engine.stats.steps
    print(f"# {cpu_name()}, {args.threads} threads, torch {torch.__version__}; B={args.groups} "
          f"n={args.n} max_tokens={args.max_tokens} over_sample={args.over_sample} "
          f"max_staleness={args.staleness}")
    for step in range(args.steps):
        # Each system draws its own fresh questions (the seed is the step's); the order of the
        # two alternates so neither always runs on a warmer machine.
        for run in runs if step % 2 == 0 else runs[::-1]:
            count = run.new_prompts()
            prompts = [render(tok, [{"role": "system", "content": SYSTEM},
                                    {"role": "user", "content": q}])
                       for q in questions(count, 1000 * step + (run.name == "partial"))]
            run.step(prompts, params)
            print(f"step {step} {run.name:8s} {run.seconds[-1]:7.2f} s  "
                  f"carried {len(run.engine.carried)}", flush=True)
        perturb(model, step, args.update_scale)
        for run in runs:
            run.engine.sleep()
            run.engine.wake_up()
            run.engine.update_weights(model)

    print("\n| | sync | partial |\n|---|---|---|")
    rows = {}
    for run in runs:
        stats = run.engine.stats
        trained_tokens = sum(len(s.token_ids) for s in run.trained)
        rows[run.name] = {
            "rollout s / step": sum(run.seconds) / len(run.seconds),
            "samples trained / rollout s": len(run.trained) / sum(run.seconds),
            "tokens generated / token trained":
                (stats.generated_tokens - run.generated_before) / trained_tokens,
            # What the tail costs where a step's cost hardly depends on its batch (a GPU).
            "engine steps / step": (stats.steps - run.steps_before) / len(run.seconds),
            "retracted sequences": stats.retracted,
            "stale groups restarted": stats.stale_restarts,
        }
    for key in rows["sync"]:
        print(f"| {key} | {rows['sync'][key]:.3g} | {rows['partial'][key]:.3g} |")
    ratio = (rows["partial"]["samples trained / rollout s"]
             / rows["sync"]["samples trained / rollout s"])
    print(f"\npartial / sync, samples trained per rollout second: {ratio:.2f}x (goal >= 1.5x)")
    for run in runs:
        lengths = collections.Counter(min(len(s.token_ids) // 16, args.max_tokens // 16)
                                      for s in run.trained)
        hist = " ".join(f"{16 * b}-{16 * b + 15}:{lengths[b]}" for b in sorted(lengths))
        print(f"{run.name} lengths (tokens: samples) {hist}")
        print(f"{run.name} staleness of trained samples' first tokens "
              f"(versions: samples) {dict(sorted(run.staleness.items()))}")


def exactness(plain, carrying, model, tok, args) -> None:
    """Seeded requests uninterrupted on `plain`, carried through a sleep on `carrying`."""
    from rollout import SamplingParams

    prompts = [render(tok, [{"role": "system", "content": SYSTEM},
                            {"role": "user", "content": q}]) for q in questions(args.groups, 7)]
    params = [SamplingParams(n=args.n, temperature=1.0, max_tokens=args.max_tokens, seed=i,
                             logprobs=True) for i in range(len(prompts))]
    want = {tuple(o.prompt_token_ids): o for o in plain.generate(prompts, params)}
    got = carrying.rollout(prompts, params, groups=len(prompts) // 2)
    carried = set(carrying.carried)
    carrying.sleep(2)
    carrying.wake_up()
    carrying.update_weights(model)
    got += carrying.rollout()
    differ, first, samples, gap = 0, [], 0, 0.0
    for out in got:
        if out.request_id not in carried:
            continue
        for a, b in zip(out.samples, want[tuple(out.prompt_token_ids)].samples):
            samples += 1
            n = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y),
                     None)
            if n is None and len(a.token_ids) == len(b.token_ids):
                gap = max([gap, *(abs(x - y) for x, y in zip(a.logprobs, b.logprobs))])
                continue
            differ += 1
            first.append(n)
    print(f"# {cpu_name()}, {args.threads} threads; {samples} carried samples "
          f"({carrying.stats.retracted} sequences retracted mid-sample)")
    print(f"samples whose tokens differ from the uninterrupted run: {differ} of {samples}; "
          f"first differing output token: {first}")
    print(f"largest logprob gap on identical samples: {gap:.2e}")


if __name__ == "__main__":
    main()
