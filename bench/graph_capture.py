"""What CUDA graphs cost at every wake-up. Sleep drops the decode graphs (the pool and weights
they point at are freed), so after each wake-up every batch-size bucket a rollout passes through
is captured again (a warm-up forward, then the capture) before it replays. Per bucket: the
first capture, the capture after a sleep, a graphed decode step and an eager one at that batch
(best of --repeats each), and how many graphed steps a recapture costs. Last, the sum over the
buckets: what a rollout whose batch drains through all of them pays per wake-up. Random weights
of --model-shape, one engine with graphs and one without. Not in CI (needs CUDA; the smoke
test runs it on the CPU stand-in).

    python bench/graph_capture.py --device cuda --model-shape smollm2 --dtype bfloat16
        [--buckets 1,2,4,8,16,24,32,64,128,256] [--repeats 3] [--steps 16]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from workloads import add_model_args, grpo_prompts, model_from_args  # noqa: E402

from rollout import Engine, EngineConfig, SamplingParams  # noqa: E402


def timed(engine: Engine, prompts, params) -> tuple[float, int, float]:
    """(forward seconds per step, captures, capture seconds) of one generate call."""
    before = engine.stats
    forward, steps = before.forward_seconds, before.steps
    captures, capture_s = before.graph_captures, before.graph_capture_seconds
    engine.generate(prompts, params)
    after = engine.stats
    return ((after.forward_seconds - forward - (after.graph_capture_seconds - capture_s))
            / (after.steps - steps), after.graph_captures - captures,
            after.graph_capture_seconds - capture_s)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(ap, shape_default="smollm2")
    ap.add_argument("--buckets", default="1,2,4,8,16,24,32,64,128,256")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=16, help="decode steps a timed call runs")
    args = ap.parse_args()
    _, model = model_from_args(args)
    buckets = [int(b) for b in args.buckets.split(",")]
    # The triton backend: CUDA graphs need it (on the CPU, under TRITON_INTERPRET=1, the graphs'
    # eager stand-in runs: a smoke check of this script, not a measurement).
    config = dict(kv_cache_tokens=max(buckets) * 64, max_model_len=64,
                  max_num_seqs=max(buckets), seed=0, backend="triton")
    graphed = Engine(model, EngineConfig(**config, cuda_graphs=True))
    eager = Engine(model, EngineConfig(**config))
    # ignore_eos: every call runs --steps steps; the prompts' last token is the first step's
    # input once they are cached, so a repeated call is decode steps only.
    params = SamplingParams(temperature=1.0, max_tokens=args.steps, ignore_eos=True, seed=0)
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device
    print(f"# {name}, {args.model_shape} shapes (random weights), {args.dtype}; "
          f"{args.steps} decode steps a call, best of {args.repeats}")
    print("| batch | first capture ms | capture after sleep ms | graphed step ms | eager step ms |"
          " graphed steps a recapture costs |\n|---|---|---|---|---|---|")
    total_first = total_again = 0.0
    for b in buckets:
        prompts = grpo_prompts(b, 32, 0, model.config.vocab_size, seed=b)
        _, captures, first = timed(graphed, prompts, params)  # prefill eager, then the capture
        assert captures == 1, captures
        eager.generate(prompts, params)
        step = min(timed(graphed, prompts, params)[0] for _ in range(args.repeats))
        eager_step = min(timed(eager, prompts, params)[0] for _ in range(args.repeats))
        again = float("inf")
        for _ in range(args.repeats):
            graphed.sleep(1)
            graphed.wake_up()
            graphed.generate(prompts, SamplingParams(max_tokens=1))  # the prompts cached again
            again = min(again, timed(graphed, prompts, params)[2])
        total_first, total_again = total_first + first, total_again + again
        print(f"| {b} | {first * 1e3:.1f} | {again * 1e3:.1f} | {step * 1e3:.2f} | "
              f"{eager_step * 1e3:.2f} | {again / step:.0f} |", flush=True)
    print(f"\nall {len(buckets)} buckets: first captures {total_first:.2f} s, after a sleep "
          f"{total_again:.2f} s (what each wake-up costs a rollout draining through them)")


if __name__ == "__main__":
    main()
