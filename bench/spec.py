"""Speculative decoding against plain decoding on the same engine, model and prompts.

Workloads: (a) copy-heavy, n-gram drafts (a prompt made of a repeated block, greedy);
(b) n = 8 sibling samples at temperature 0.7, n-gram drafts over the siblings;
(c) a draft model that is the target with noise added to its weights.
For each: wall time with and without speculation, their ratio, target forwards (engine steps)
per emitted token per sample, acceptance rate and tokens per verification. Nothing asserted.

    python bench/spec.py                              # CPU, ~25M Qwen2-style model
    python bench/spec.py --device cuda --model-shape 0.5b --dtype bfloat16 --batches 1,8,64
"""

from __future__ import annotations

import argparse
import copy
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from workloads import add_model_args, model_from_args  # noqa: E402

from rollout import Engine, EngineConfig, SamplingParams  # noqa: E402
from rollout.engine.stats import EngineStats  # noqa: E402
from rollout.spec import SpeculativeConfig  # noqa: E402

# What report() reads of a timed run.
COUNTERS = ("generated_tokens", "steps", "spec_proposed", "spec_accepted", "spec_verifications",
            "spec_emitted")


def noisy_copy(model, scale: float, seed: int = 0):
    """The target with Gaussian noise of `scale` x each weight's std: a stand-in draft that
    agrees with the target most of the time, as a distilled draft would."""
    draft = copy.deepcopy(model)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            noise = torch.randn(p.shape, generator=gen).to(p.device, p.dtype)
            p.add_(noise * p.float().std().to(p.dtype) * scale)
    return draft


def since(base: dict, now: dict) -> EngineStats:
    """The counters of what ran between two Engine.stats.as_dict() snapshots, and so its rates
    (acceptance_rate, tokens_per_verification) without the warm-up's drafts."""
    return EngineStats(**{k: now[k] - base[k] for k in COUNTERS})


def timed(model, prompts, params, spec, args):
    config = EngineConfig(kv_cache_tokens=args.kv_tokens, max_model_len=2048,
                          max_num_seqs=512, speculative=spec)
    engine = Engine(model, config)
    engine.generate(prompts[:1], SamplingParams(max_tokens=4, seed=1))  # warm-up / compile
    base = engine.stats.as_dict()
    if args.device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params)
    if args.device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    run = since(base, engine.stats.as_dict())
    samples = sum(len(o.samples) for o in outs)
    return seconds, run.steps * samples / run.generated_tokens, run


def report(name, batch, plain, spec):
    t0, f0, _ = plain
    t1, f1, s = spec
    print(f"{name:<28} batch {batch:>3}: plain {t0:6.2f}s  spec {t1:6.2f}s  speed-up "
          f"{t0 / t1:4.2f}x | target forwards/token {f0:4.2f} -> {f1:4.2f} | acceptance "
          f"{s.acceptance_rate:.2f}, tokens/verification {s.tokens_per_verification:.2f}, "
          f"proposed {s.spec_proposed}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(ap)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--max-new", type=int, default=96)
    ap.add_argument("--kv-tokens", type=int, default=65536)
    ap.add_argument("--draft-noise", type=float, default=0.05)
    args = ap.parse_args()
    shape, model = model_from_args(args)
    draft = noisy_copy(model, args.draft_noise)
    vocab = shape["vocab_size"]
    rng = random.Random(0)
    ngram = SpeculativeConfig("ngram", num_speculative_tokens=args.k, max_batch_size=256)
    drafted = SpeculativeConfig("draft", num_speculative_tokens=args.k, draft_model=draft,
                                max_batch_size=256)
    print(f"{model.config.model_type} {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M, "
          f"{args.model_shape} shapes, {args.dtype} "
          f"on {args.device}, k={args.k}, {args.max_new} new tokens")
    for batch in [int(b) for b in args.batches.split(",")]:
        block = [[rng.randrange(vocab) for _ in range(24)] for _ in range(batch)]
        copy_prompts = [b * 6 for b in block]
        greedy = SamplingParams(temperature=0, max_tokens=args.max_new, ignore_eos=True)
        report("(a) copy-heavy, ngram", batch, timed(model, copy_prompts, greedy, None, args),
               timed(model, copy_prompts, greedy, ngram, args))
        prompts = [[rng.randrange(vocab) for _ in range(64)] for _ in range(max(1, batch // 8))]
        siblings = SamplingParams(n=8, temperature=0.7, max_tokens=args.max_new,
                                  ignore_eos=True, seed=0)
        report("(b) n=8 siblings T=0.7", len(prompts) * 8,
               timed(model, prompts, siblings, None, args),
               timed(model, prompts, siblings, ngram, args))
        sampled = SamplingParams(temperature=0.7, max_tokens=args.max_new, ignore_eos=True, seed=0)
        plain_prompts = [p[:32] for p in copy_prompts]
        report("(c) noisy-copy draft T=0.7", batch,
               timed(model, plain_prompts, sampled, None, args),
               timed(model, plain_prompts, sampled, drafted, args))


if __name__ == "__main__":
    main()
