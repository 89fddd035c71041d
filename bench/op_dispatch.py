"""What calling the C kernels through their torch operators (kernels/cpu/ops.py) would cost an
engine's decode, the reason the eager path calls the C directly and takes the operators only
while the profiler records or dynamo traces.

A random-weight Llama of SmolLM2-135M's shapes on the cpu backend decodes --prompts prompts x
--n samples for --tokens tokens, twice per round: kernels called directly (the engine's eager
path), and every kernel call through torch's dispatcher (the path the profiler sees, forced
here by the bench's switch; the product has none). Rounds interleaved, best of --repeat. It
prints both times, their ratio, and the operator calls per decode step (counted once, with a
dispatch mode).

    python bench/op_dispatch.py [--prompts 1 16] [--n 8] [--tokens 32] [--repeat 5]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from workloads import SMOLLM2_135M, cpu_name, grpo_prompts, random_llama  # noqa: E402

from rollout import Engine, EngineConfig, SamplingParams  # noqa: E402
from rollout_kernels.cpu import ops  # noqa: E402


class Operators:
    """The bench's switch: inside it, every kernel call goes through its operator."""

    def __enter__(self):
        self.saved, ops.watched = ops.watched, lambda: True

    def __exit__(self, *exc):
        ops.watched = self.saved


class CountCalls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == ops.NAMESPACE:
            self.calls[func.name()] += 1
        return func(*args, **(kwargs or {}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = random_llama(SMOLLM2_135M)
    print(f"{cpu_name()}; torch {torch.__version__}, {args.threads} threads; "
          f"SmolLM2-135M shapes, fp32, backend cpu")
    for num_prompts in args.prompts:
        engine = Engine(model, EngineConfig(backend="cpu", max_model_len=512, seed=0))
        prompts = grpo_prompts(num_prompts, 96, 64, SMOLLM2_135M["vocab_size"])
        params = SamplingParams(temperature=1.0, max_tokens=args.tokens, n=args.n,
                                ignore_eos=True)

        def run():  # the prompts stay cached after the first run: decode steps dominate
            start = time.perf_counter()
            engine.generate(prompts, params)
            return time.perf_counter() - start

        run()  # warm: the kernels built, the weights packed
        best = {"direct": float("inf"), "operators": float("inf")}
        for _ in range(args.repeat):
            best["direct"] = min(best["direct"], run())
            with Operators():
                best["operators"] = min(best["operators"], run())
        with Operators(), CountCalls() as counted:
            engine.generate(prompts, SamplingParams(temperature=1.0, max_tokens=2, n=args.n,
                                                    ignore_eos=True))
        # Two tokens: one prefill step, one decode step; the decode step's calls are the
        # difference from a one-token run.
        with Operators(), CountCalls() as prefill_only:
            engine.generate(prompts, SamplingParams(temperature=1.0, max_tokens=1, n=args.n,
                                                    ignore_eos=True))
        per_step = sum(counted.calls.values()) - sum(prefill_only.calls.values())
        batch = num_prompts * args.n
        print(f"batch {batch:4d} x {args.tokens} tokens: direct {best['direct']:.3f} s, "
              f"through operators {best['operators']:.3f} s = "
              f"{best['operators'] / best['direct']:.3f}x; {per_step} operator calls a decode "
              f"step, {(best['operators'] - best['direct']) / args.tokens * 1e3:.2f} ms a "
              f"step more (best of {args.repeat}, interleaved)")


if __name__ == "__main__":
    main()
