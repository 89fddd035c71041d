"""How far seeded samples depend on what else shares the batch, in fp32 and bf16.

Each seeded request is generated alone, then inside one batch with the others (and n = 8
siblings each): the counter noise is the same, so any difference comes from the logits, whose
last bits can depend on the batch shape (matmul blocking, attention splits). Prints, per dtype,
the share of samples whose tokens are identical and the largest logprob difference over the
tokens up to the first divergence. Nothing asserted.

    python bench/batch_invariance.py                        # CPU, ~25M Qwen2-style model
    python bench/batch_invariance.py --device cuda --model-shape 0.5b
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from workloads import QWEN2_05B, QWEN2_25M, grpo_prompts, random_qwen2  # noqa: E402

from rollout import Engine, EngineConfig, SamplingParams  # noqa: E402


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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model-shape", choices=["25m", "0.5b"], default="25m")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-new", type=int, default=64)
    args = ap.parse_args()
    shape = QWEN2_25M if args.model_shape == "25m" else QWEN2_05B
    prompts = grpo_prompts(args.prompts, 96, 64, shape["vocab_size"])
    params = [SamplingParams(n=args.n, temperature=1.0, max_tokens=args.max_new, seed=i,
                             logprobs=True, ignore_eos=True) for i in range(len(prompts))]
    for dtype in (torch.float32, torch.bfloat16):
        model = random_qwen2(shape, dtype, args.device)
        engine = Engine(model, EngineConfig(kv_cache_tokens=65536, max_model_len=512))
        alone = [engine.generate([p], [sp])[0] for p, sp in zip(prompts, params)]
        batched = engine.generate(prompts, params)
        same, total, worst = compare(alone, batched)
        print(f"{str(dtype):15s} identical samples {same}/{total} ({same / total:.0%}), "
              f"max logprob diff before divergence {worst:.2e}")


if __name__ == "__main__":
    main()
