"""GRPO-shaped rollout: the engine against transformers `generate` on the same model and prompts.

Default (CPU): a ~25M-parameter Qwen2-style model with random weights, 16 prompts of 192 tokens
sharing a 128-token system prefix, n = 8, 128 new tokens, temperature 1.
Prints tokens/s of both, their ratio, prompt tokens each computed, the engine's time outside
the model forward as a share of its step time, and the garbage collector's pauses in its run.
On CUDA, last, a short decode-heavy run under the profiler: kernels launched per step and the
share of wall time the GPU spends in them (a low share means steps are bound by the host,
launches and scheduling, which CUDA graphs address).
Nothing is asserted.

    python bench/engine_vs_hf.py [--device cuda --model-shape 0.5b|smollm2 --dtype bfloat16]
        [--cuda-graphs off|on|both] [--skip-hf] [--calls K]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from workloads import CollectorPauses, add_model_args, grpo_prompts, model_from_args  # noqa: E402

from rollout import Engine, EngineConfig, SamplingParams  # noqa: E402
from rollout.engine.stats import STEP_PHASES  # noqa: E402


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_hf(model, prompts, n, max_new, device):
    ids = torch.tensor(prompts, device=device)
    sync(device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True,
                             temperature=1.0, top_k=0, top_p=1.0, num_return_sequences=n,
                             max_new_tokens=max_new, min_new_tokens=max_new)
    sync(device)
    seconds = time.perf_counter() - t0
    generated = (out.shape[1] - ids.shape[1]) * out.shape[0]
    return generated, seconds, ids.numel() * n  # HF expands prompts n times before prefill


def run_engine(model, prompts, n, max_new, args, cuda_graphs: bool):
    config = EngineConfig(kv_cache_tokens=args.kv_tokens, max_model_len=1024,
                          max_num_seqs=max(256, len(prompts) * n),
                          max_num_batched_tokens=args.batched_tokens,
                          cuda_graphs=cuda_graphs, keep_cpu_heap=True)
    engine = Engine(model, config)
    params = SamplingParams(n=n, temperature=1.0, max_tokens=max_new, ignore_eos=True, seed=0)
    # Warm-up (kernel compilation on GPU) on other prompts, so nothing of the run is cached.
    warm = grpo_prompts(2, len(prompts[0]), 0, model.config.vocab_size, seed=99)
    engine.generate(warm, SamplingParams(n=2, max_tokens=4, seed=1))
    base = engine.stats.as_dict()
    sync(args.device)
    t0 = time.perf_counter()
    with CollectorPauses() as pauses:
        # --calls > 1: the same rollout again, as a training run's steps do (the radix cache
        # serves the prompts then; what grows call after call is the collector's work).
        outs = [o for _ in range(args.calls) for o in engine.generate(prompts, params)]
        sync(args.device)
    seconds = time.perf_counter() - t0
    print(f"engine (cuda_graphs={cuda_graphs}): {pauses.summary(seconds)}")
    s = engine.stats.as_dict()
    delta = {k: s[k] - base[k] for k in ("generated_tokens", "prompt_tokens_computed", "steps",
                                         "step_seconds", *STEP_PHASES)}
    generated = sum(len(smp.token_ids) for o in outs for smp in o.samples)
    return generated, seconds, delta, engine


def gpu_busy(engine, prompts, n) -> None:
    """Kernels per engine step and the GPU's busy share of the wall time, over 16 decode
    steps at the run's batch size. The profiler slows the host, so the share is a lower bound."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    params = SamplingParams(n=n, temperature=1.0, max_tokens=16, ignore_eos=True, seed=2)
    steps = engine.stats.steps
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        engine.generate(prompts, params)
        torch.cuda.synchronize()
        wall_us = (time.perf_counter() - t0) * 1e6
    steps = engine.stats.steps - steps
    on_gpu = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    busy_us = sum(e.time_range.elapsed_us() for e in on_gpu)
    print(f"profiled ({steps} steps, prompts cached): {len(on_gpu) / steps:.0f} kernels and "
          f"copies per step, GPU busy {busy_us / wall_us:.0%} of the wall time "
          f"({wall_us / steps / 1e3:.2f} ms per step)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(ap)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=192)
    ap.add_argument("--prefix-len", type=int, default=128)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--calls", type=int, default=1, help="engine generate calls in a row")
    ap.add_argument("--kv-tokens", type=int, default=65536)
    ap.add_argument("--batched-tokens", type=int, default=8192)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--cuda-graphs", choices=["off", "on", "both"], default="off",
                    help="replay decode steps from graphs; both: one engine each way, one model")
    args = ap.parse_args()

    shape, model = model_from_args(args)
    params_m = sum(p.numel() for p in model.parameters()) / 1e6
    prompts = grpo_prompts(args.prompts, args.prompt_len, args.prefix_len, shape["vocab_size"])
    print(f"model: {model.config.model_type} {params_m:.1f}M params (random weights, "
          f"{args.model_shape} shapes), {args.dtype} on {args.device}, "
          f"{torch.get_num_threads()} threads")
    print(f"workload: {args.prompts} prompts x {args.prompt_len} tokens "
          f"({args.prefix_len} shared), n={args.n}, {args.max_new} new tokens, temperature 1")

    graphs = {"off": [False], "on": [True], "both": [False, True]}[args.cuda_graphs]
    rates = {}
    for cuda_graphs in graphs:
        gen, secs, d, engine = run_engine(model, prompts, args.n, args.max_new, args, cuda_graphs)
        rates[cuda_graphs] = gen / secs
        overhead = 1 - d["forward_seconds"] / d["step_seconds"]
        print(f"engine (cuda_graphs={cuda_graphs}): {gen / secs:9.1f} tok/s  ({gen} tokens in "
              f"{secs:.2f} s, {d['steps']} steps), prompt tokens computed "
              f"{d['prompt_tokens_computed']}, time outside the model forward {overhead:.1%}")
        per_step = ", ".join(f"{name.removesuffix('_seconds')} "
                             f"{d[name] / d['steps'] * 1e3:.2f}" for name in STEP_PHASES)
        print(f"engine ms per step: {per_step}")
        if args.device.startswith("cuda"):
            gpu_busy(engine, prompts, args.n)
        del engine  # its KV pool goes before the next one is built
    if len(rates) == 2:
        print(f"cuda graphs on / off: {rates[True] / rates[False]:.2f}x")
    if not args.skip_hf:
        compare_hf(model, prompts, args, rates)


def compare_hf(model, prompts, args, engine_rates: dict) -> None:
    gen_hf, secs_hf, prompt_hf = run_hf(model, prompts, args.n, args.max_new, args.device)
    hf_tps = gen_hf / secs_hf
    print(f"transformers: {hf_tps:9.1f} tok/s  ({gen_hf} tokens in {secs_hf:.2f} s), "
          f"prompt tokens computed {prompt_hf}")
    for cuda_graphs, tps in engine_rates.items():
        print(f"ratio engine (cuda_graphs={cuda_graphs}) / transformers: {tps / hf_tps:.2f}x   "
              f"(goal >= 2x; overhead goal <= 10%)")


if __name__ == "__main__":
    main()
