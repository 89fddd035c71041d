"""How far seeded samples depend on what else shares the batch, and what
EngineConfig(batch_invariant=True) costs, on SmolLM2-135M-Instruct in fp32 and bf16 (CPU by
default).

Each seeded request is generated alone (no prefix cache), then inside one batch with the others
(n samples each, prompts behind one system prompt): the counter noise is the same, so any
difference comes from the logits, whose last bits can depend on the batch shape (matmul
blocking, attention splits, SDPA prefill). Prints, per dtype and mode, the share of samples
whose tokens are identical, the largest logprob difference before a sample's divergence, and
the batched rollout's tokens/s, the modes interleaved and the best of --repeats kept (the
machine is shared), and for each mode's best call the forward's and the rest's ms a step (where
a cost lies). Nothing asserted.

    python bench/batch_invariance.py                     # SmolLM2-135M, fp32 and bf16
    python bench/batch_invariance.py --model-shape 25m   # a random 25M Qwen2 instead
    python bench/batch_invariance.py --model-shape moe   # a random small Qwen3-MoE (top-8 of 32)
    python bench/batch_invariance.py --device cuda --model-shape smollm2-random
        # on a GPU (the Triton backend's invariant mode; CUDA graphs off, the engine's
        # default): SmolLM2-135M's shapes with random weights, since its checkpoint does not
        # travel to the GPU machine
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from workloads import (QWEN2_25M, QWEN3_MOE_SMALL, SMOLLM2_135M, cpu_name,  # noqa: E402
                       grpo_prompts, random_llama, random_qwen2, random_qwen3_moe)

from rollout import Engine, EngineConfig, SamplingParams  # noqa: E402
from rollout.engine.stats import STEP_PHASES  # noqa: E402


def compare(alone, batched) -> tuple[int, int, float]:
    """(identical samples, samples, max |logprob diff| before each sample's divergence)."""
    same, total, worst = 0, 0, 0.0
    for a, b in zip(alone, batched):
        for sa, sb in zip(a.samples, b.samples):
            total += 1
            same += sa.token_ids == sb.token_ids
            for ta, tb, la, lb in zip(sa.token_ids, sb.token_ids, sa.logprobs, sb.logprobs):
                if ta != tb:
                    break
                worst = max(worst, abs(la - lb))
    return same, total, worst


def load(name: str, dtype: torch.dtype, device: str):
    if name == "25m":
        return random_qwen2(QWEN2_25M, dtype, device), QWEN2_25M["vocab_size"]
    if name == "moe":
        return random_qwen3_moe(QWEN3_MOE_SMALL, dtype, device), QWEN3_MOE_SMALL["vocab_size"]
    if name == "smollm2-random":
        return random_llama(SMOLLM2_135M, dtype, device), SMOLLM2_135M["vocab_size"]
    from rollout_recipes.run import smollm2

    model = smollm2.load_model(dtype).to(device)
    return model, model.config.vocab_size


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-shape", choices=["smollm2", "smollm2-random", "25m", "moe"],
                    default="smollm2")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtypes", nargs="+", choices=["float32", "bfloat16"],
                    default=["float32", "bfloat16"])
    args = ap.parse_args()
    where = (torch.cuda.get_device_name() if args.device.startswith("cuda")
             else f"{cpu_name()}, {torch.get_num_threads()} threads")
    print(f"{where}; {args.model_shape}, "
          f"{args.prompts} prompts x n={args.n} x {args.max_new} tokens")
    for dtype in (getattr(torch, name) for name in args.dtypes):
        model, vocab = load(args.model_shape, dtype, args.device)
        prompts = grpo_prompts(args.prompts, 96, 64, vocab)
        params = [SamplingParams(n=args.n, temperature=1.0, max_tokens=args.max_new, seed=i,
                                 logprobs=True, ignore_eos=True) for i in range(len(prompts))]
        best = {}
        for invariant in (False, True):
            config = dict(kv_cache_tokens=16384, max_model_len=512, batch_invariant=invariant)
            solo = Engine(model, EngineConfig(**config, enable_prefix_caching=False))
            alone = [solo.generate([p], [sp])[0] for p, sp in zip(prompts, params)]
            del solo
            batched = Engine(model, EngineConfig(**config)).generate(prompts, params)
            same, total, worst = compare(alone, batched)
            print(f"{str(dtype)[6:]:9s} batch_invariant={invariant!s:5s}: identical samples "
                  f"{same}/{total}, max logprob diff before divergence {worst:.2e}")
        phases = {}  # mode -> the best call's ms a step of forward and of the rest
        for _ in range(args.repeats):  # interleaved: both modes see the same machine load
            for invariant in (False, True):
                # a fresh engine (cold cache: the prompts' prefill counts), built untimed
                engine = Engine(model, EngineConfig(kv_cache_tokens=16384, max_model_len=512,
                                                    batch_invariant=invariant))
                start = time.perf_counter()
                outs = engine.generate(prompts, params)
                seconds = time.perf_counter() - start
                tokens = sum(len(s.token_ids) for o in outs for s in o.samples)
                if tokens / seconds > best.get(invariant, 0.0):
                    best[invariant] = tokens / seconds
                    phases[invariant] = step_ms(engine.stats)
        print(f"{str(dtype)[6:]:9s} rollout tok/s (best of {args.repeats}): default "
              f"{best[False]:.1f}, batch_invariant {best[True]:.1f}: cost "
              f"{1 - best[True] / best[False]:+.1%}")
        for invariant in (False, True):  # where the cost lies: the forward or the rest
            forward, rest, steps = phases[invariant]
            print(f"{str(dtype)[6:]:9s} batch_invariant={invariant!s:5s}: {steps} steps, "
                  f"forward {forward:.2f} ms a step, the rest {rest:.2f}")


def step_ms(stats) -> tuple[float, float, int]:
    """(forward ms a step, the step's other phases' ms, steps) of an engine's calls so far."""
    forward = stats.forward_seconds / stats.steps * 1e3
    rest = sum(getattr(stats, p) for p in STEP_PHASES if p != "forward_seconds")
    return forward, rest / stats.steps * 1e3, stats.steps


if __name__ == "__main__":
    main()
