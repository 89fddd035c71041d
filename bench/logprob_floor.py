"""How exact the engine's fp32 logprobs are, against how exact transformers' own are: both held to
a float64 copy of the same model (the exact answer, floors.exact_copy), per family, on the
parity tests' tiny random models and prompts (24 greedy tokens each), and on
SmolLM2-135M-Instruct with --real.
Prints each one's mean and largest error from float64 and their ratios (the parity tests assert
the mean <= 2x and the largest <= 4x: tests/support/floors.py). Names the CPU and its widest
vector ISA. Not in CI.

    python bench/logprob_floor.py [--real] [--backend cpu|torch]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests", "support"), os.path.join(ROOT, "bench")]
from floors import exact_copy, token_logprobs  # noqa: E402
from models import FAMILIES, tiny_model  # noqa: E402
from reference import PROMPTS  # noqa: E402
from workloads import cpu_name  # noqa: E402

from rollout import Engine, EngineConfig, SamplingParams  # noqa: E402


def errors(model, prompts, backend: str) -> tuple[torch.Tensor, ...]:
    """|logprob - float64 logprob| over every token: the engine's; transformers' float32
    forward with a float32 log_softmax (what a trainer computes, and what the parity tests take
    as the floor); the same logits with a float64 log_softmax (how much of the floor is the
    log_softmax's own rounding)."""
    engine = Engine(model, EngineConfig(kv_cache_tokens=4096, max_model_len=512,
                                        backend=backend))
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=24, logprobs=True))
    exact = exact_copy(model)
    found = [], [], []
    for prompt, out in zip(prompts, outs):
        tokens = out.samples[0].token_ids
        truth = token_logprobs(exact, prompt, tokens)
        with torch.no_grad():
            logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1]
        picked = torch.tensor(tokens)[:, None]
        ref = logits.float().log_softmax(-1).gather(-1, picked)[:, 0].double()
        ref64 = logits.double().log_softmax(-1).gather(-1, picked)[:, 0]
        got = torch.tensor(out.samples[0].logprobs, dtype=torch.float64)
        for errs, value in zip(found, (got, ref, ref64)):
            errs.append((value - truth).abs())
    return tuple(torch.cat(errs) for errs in found)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--real", action="store_true", help="SmolLM2-135M-Instruct too")
    ap.add_argument("--backend", default="auto")
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"{cpu_name()}; torch {torch.__version__}; backend {args.backend}")
    print(f"{'model':14} {'engine mean':>11} {'hf mean':>9} {'ratio':>6}  "
          f"{'engine max':>10} {'hf max':>9} {'ratio':>6}  {'hf mean, f64 log_softmax':>24}")
    cases = [(family, tiny_model(family), PROMPTS) for family in FAMILIES]
    if args.real:
        from rollout_recipes.run import smollm2

        model, tok = smollm2.load()
        chats = [[{"role": "user", "content": q}] for q in ("What is 13 + 7?",
                                                           "Name three primary colours.")]
        cases.append(("smollm2-135m", model, [tok.apply_chat_template(
            c, add_generation_prompt=True, tokenize=True, return_dict=False) for c in chats]))
    for name, model, prompts in cases:
        e, r, r64 = errors(model, [list(p) for p in prompts], args.backend)
        print(f"{name:14} {e.mean():11.2e} {r.mean():9.2e} {e.mean() / r.mean():6.2f}  "
              f"{e.max():10.2e} {r.max():9.2e} {e.max() / r.max():6.2f}  {r64.mean():24.2e}")


if __name__ == "__main__":
    main()
