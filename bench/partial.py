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
  complete group; the others go on in the next step. Carried samples re-prefill their context
  after each update (EngineConfig(carried_kv="recompute")).
- partial-park (with `--carried-kv recompute park`): the same, but carried samples keep their
  K/V (carried_kv="park": parked on the host through the sleep, then gone on from as the old
  weights' K/V).

The systems are separate engines on the same weights, run step by step interleaved (the
machine is shared and noisy). Reported: rollout seconds per step (only the generate/rollout
calls), samples trained per rollout second and the ratio partial/sync (the goal is >= 1.5),
engine steps per training step, where a training step's rollout time goes (the engine steps'
phases, CUDA-graph captures, the rest of the call), tokens generated per token trained (tokens of
restarted samples and of groups still carried at the end count as generated), the histogram of
completion lengths, and how stale the trained samples' oldest tokens are.

`--exact` measures instead how often carrying changes a token: the same seeded requests, run
uninterrupted by one engine and by another that returns half of them, sleeps (level 2), takes
the same weights back and finishes the rest (re-prefilling what it had decoded, or going on from
its parked K/V: one carrying engine per `--carried-kv` mode); it counts the carried samples whose
tokens differ from the uninterrupted run's, and where they first differ.

`--model-shape` runs random weights of a shape instead (for the GPU machine, which the real
checkpoint cannot reach): prompts of token ids behind one 280-token system prompt, and, since
random weights never pick EOS on purpose, answer lengths drawn by `stop_token_ids`: the first
vocab / `--mean-tokens` ids stop a sample, so near-uniform logits end it with probability about
1 / mean-tokens a token (geometric lengths, cut at `--max-tokens`: a long tail as real answers
have one).

    python bench/partial.py [--steps 6] [--groups 8] [--n 8] [--max-tokens 128] [--threads 2]
                            [--carried-kv recompute park]
    python bench/partial.py --exact [--groups 16] [--carried-kv recompute park]
    python bench/partial.py --device cuda --dtype bfloat16 --model-shape smollm2 --cuda-graphs \
        [--mean-tokens 64] [--max-tokens 256]
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from peers import SYSTEM, questions, render  # noqa: E402
from workloads import add_model_args, cpu_name, grpo_prompts, model_from_args  # noqa: E402

from rollout.engine.stats import STEP_PHASES  # noqa: E402

# EngineStats fields read before and after the timed steps (the warm-up's are not the run's).
COUNTED = ("generated_tokens", "steps", "step_seconds", *STEP_PHASES, "graph_capture_seconds",
           "graph_captures")


def perturb(model, step: int, scale: float) -> None:
    """A small random step on every weight (the trainer's update, as far as the engine sees)."""
    gen = torch.Generator().manual_seed(step)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen).to(p) * scale * p.abs().mean())


class Workload:
    """Prompts for a step and the sampling settings every request takes."""

    stop: list[int] = []

    def params(self, **kw):
        from rollout import SamplingParams

        return SamplingParams(stop_token_ids=self.stop, **kw)


class ChatWorkload(Workload):
    """The real checkpoint's chat prompts: bench/peers.py's system prompt and questions; EOS
    ends an answer."""

    def __init__(self, tok) -> None:
        self.tok = tok

    def prompts(self, count: int, seed: int) -> list[list[int]]:
        return [render(self.tok, [{"role": "system", "content": SYSTEM},
                                  {"role": "user", "content": q}])
                for q in questions(count, seed)]


class RandomWorkload(Workload):
    """Random weights: token-id prompts behind one system prompt, lengths by stop_token_ids."""

    def __init__(self, vocab: int, mean_tokens: int) -> None:
        self.vocab = vocab
        self.system = grpo_prompts(1, 280, 280, vocab, seed=0)[0]
        self.stop = list(range(max(1, vocab // mean_tokens)))

    def prompts(self, count: int, seed: int) -> list[list[int]]:
        return [self.system + q for q in grpo_prompts(count, 20, 0, self.vocab, seed=seed + 1)]


SYNC = "sync"
PARTIAL = {"recompute": "partial", "park": "partial-park"}  # carried_kv mode -> system


class Run:
    """One system's run: its engine, what it trained on and what it cost."""

    def __init__(self, name: str, engine, args) -> None:
        self.name, self.engine, self.args = name, engine, args
        self.seconds: list[float] = []
        self.trained: list = []  # samples handed to the trainer
        self.staleness = collections.Counter()
        self.stats_before: dict[str, float] = {}  # COUNTED after the warm-up

    def step(self, prompts: list[list[int]], params) -> None:
        e, args = self.engine, self.args
        t0 = time.perf_counter()
        if self.name == SYNC:
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
        if self.name == SYNC:
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
    add_model_args(ap, shape_default=None)
    ap.add_argument("--mean-tokens", type=int, default=64,
                    help="random weights: the mean answer length stop_token_ids aim at")
    ap.add_argument("--cuda-graphs", action="store_true")
    ap.add_argument("--kv-tokens", type=int, default=None)
    ap.add_argument("--carried-kv", nargs="+", default=["recompute"], choices=list(PARTIAL),
                    help="one partial system per EngineConfig.carried_kv mode")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from rollout import Engine, EngineConfig

    tok = None
    if args.model_shape:
        _, model = model_from_args(args)
        work = RandomWorkload(model.config.vocab_size, args.mean_tokens)
        machine = (torch.cuda.get_device_name() if args.device.startswith("cuda")
                   else cpu_name())
        machine += f", {args.model_shape} shapes (random weights), {args.dtype}"
    else:
        from rollout_recipes.run import smollm2

        reason = smollm2.missing()
        if reason:
            raise SystemExit(reason)
        model, tok = smollm2.load()
        work, machine = ChatWorkload(tok), f"{cpu_name()}, SmolLM2-135M-Instruct"
    extra = {} if args.kv_tokens is None else {"kv_cache_tokens": args.kv_tokens}
    config = EngineConfig(max_model_len=1024, max_num_seqs=256, seed=0, keep_cpu_heap=True,
                          max_staleness=args.staleness, cuda_graphs=args.cuda_graphs, **extra)

    def engine(carried_kv: str = "recompute"):
        return Engine(model, dataclasses.replace(config, carried_kv=carried_kv), tokenizer=tok)

    runs = [Run(SYNC, engine(), args),
            *(Run(PARTIAL[mode], engine(mode), args) for mode in args.carried_kv)]
    params = work.params(n=args.n, temperature=1.0, max_tokens=args.max_tokens)
    if args.exact:
        for mode in args.carried_kv:
            exactness(runs[0].engine, engine(mode), model, work, machine, args)
        return
    for run in runs:
        run.engine.generate(work.prompts(2, 999), params)
        run.stats_before = {k: getattr(run.engine.stats, k) for k in COUNTED}
    print(f"# {machine}, {args.threads} threads, torch {torch.__version__}; B={args.groups} "
          f"n={args.n} max_tokens={args.max_tokens} over_sample={args.over_sample} "
          f"max_staleness={args.staleness} cuda_graphs={args.cuda_graphs}")
    for step in range(args.steps):
        # Each system draws its own fresh questions (the seed is the step's); the order of the
        # two alternates so neither always runs on a warmer machine.
        for run in runs if step % 2 == 0 else runs[::-1]:
            prompts = work.prompts(run.new_prompts(), 1000 * step + (run.name != SYNC))
            run.step(prompts, params)
            print(f"step {step} {run.name:8s} {run.seconds[-1]:7.2f} s  "
                  f"carried {len(run.engine.carried)}", flush=True)
        perturb(model, step, args.update_scale)
        for run in runs:
            run.engine.sleep()
            run.engine.wake_up()
            run.engine.update_weights(model)

    names = [run.name for run in runs]
    print(f"\n| | {' | '.join(names)} |\n|---{'|---' * len(names)}|")
    rows = {}
    for run in runs:
        stats = run.engine.stats
        ran = {k: getattr(stats, k) - run.stats_before[k] for k in COUNTED}  # the timed steps'
        steps, trained_tokens = len(run.seconds), sum(len(s.token_ids) for s in run.trained)
        rows[run.name] = {
            "rollout s / step": sum(run.seconds) / steps,
            "samples trained / rollout s": len(run.trained) / sum(run.seconds),
            "tokens generated / token trained": ran["generated_tokens"] / trained_tokens,
            # What the tail costs where a step's cost hardly depends on its batch (a GPU).
            "engine steps / step": ran["steps"] / steps,
            # Where a training step's rollout time goes (ms): the engine steps' phases (the
            # forward's includes the CUDA-graph captures: sleep drops the graphs), and what
            # runs outside the steps (admission of the call's requests, carrying, returning).
            **{f"ms / step: {k.removesuffix('_seconds')}": 1e3 * ran[k] / steps
               for k in COUNTED if k.endswith("_seconds")},
            "graph captures / step": ran["graph_captures"] / steps,
            "ms / step: outside engine steps":
                1e3 * (sum(run.seconds) - ran["step_seconds"]) / steps,
            "retracted sequences": stats.retracted,
            "stale groups restarted": stats.stale_restarts,
            "K/V tokens parked": stats.parked_tokens,
            "samples gone on from stale K/V": stats.stale_kv_kept,
        }
    for key in rows[SYNC]:
        print(f"| {key} | " + " | ".join(f"{rows[name][key]:.3g}" for name in names) + " |")
    for name in names[1:]:
        ratio = (rows[name]["samples trained / rollout s"]
                 / rows[SYNC]["samples trained / rollout s"])
        print(f"\n{name} / sync, samples trained per rollout second: {ratio:.2f}x "
              f"(goal >= 1.5x)")
    for run in runs:
        lengths = collections.Counter(min(len(s.token_ids) // 16, args.max_tokens // 16)
                                      for s in run.trained)
        hist = " ".join(f"{16 * b}-{16 * b + 15}:{lengths[b]}" for b in sorted(lengths))
        print(f"{run.name} lengths (tokens: samples) {hist}")
        print(f"{run.name} staleness of trained samples' first tokens "
              f"(versions: samples) {dict(sorted(run.staleness.items()))}")


def exactness(plain, carrying, model, work, machine: str, args) -> None:
    """Seeded requests uninterrupted on `plain`, carried through a sleep on `carrying`."""
    prompts = work.prompts(args.groups, 7)
    params = [work.params(n=args.n, temperature=1.0, max_tokens=args.max_tokens, seed=i,
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
    print(f"# {machine}, {args.threads} threads, carried_kv={carrying.config.carried_kv}; "
          f"{samples} carried samples ({carrying.stats.retracted} sequences retracted "
          f"mid-sample)")
    print(f"samples whose tokens differ from the uninterrupted run: {differ} of {samples}; "
          f"first differing output token: {first}")
    print(f"largest logprob gap on identical samples: {gap:.2e}")


if __name__ == "__main__":
    main()
