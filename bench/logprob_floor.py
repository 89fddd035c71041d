"""How exact the engine's fp32 logprobs are, against how exact transformers' own are: both held to
a float64 copy of the same model (the exact answer), per family, on the parity tests' tiny
random models and prompts (24 greedy tokens each), and on SmolLM2-135M-Instruct with --real.
Prints each one's largest error from float64 and their ratio (the parity tests assert <= 2:
tests/support/reference.py). Names the CPU and its widest vector ISA. Not in CI.

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


def errors(model, prompts, backend: str) -> tuple[float, float]:
    engine = Engine(model, EngineConfig(kv_cache_tokens=4096, max_model_len=512,
                                        backend=backend))
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=24, logprobs=True))
    exact = exact_copy(model)
    engine_err = ref_err = 0.0
    for prompt, out in zip(prompts, outs):
        tokens = out.samples[0].token_ids
        truth = token_logprobs(exact, prompt, tokens)
        ref = token_logprobs(model, prompt, tokens)
        got = torch.tensor(out.samples[0].logprobs, dtype=torch.float64)
        engine_err = max(engine_err, (got - truth).abs().max().item())
        ref_err = max(ref_err, (ref - truth).abs().max().item())
    return engine_err, ref_err


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--real", action="store_true", help="SmolLM2-135M-Instruct too")
    ap.add_argument("--backend", default="auto")
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"{cpu_name()}; torch {torch.__version__}; backend {args.backend}")
    print(f"{'model':14} {'engine err':>11} {'transformers':>13} {'ratio':>6}")
    cases = [(family, tiny_model(family), PROMPTS) for family in FAMILIES]
    if args.real:
        from rollout_recipes.run import smollm2

        model, tok = smollm2.load()
        chats = [[{"role": "user", "content": q}] for q in ("What is 13 + 7?",
                                                           "Name three primary colours.")]
        cases.append(("smollm2-135m", model, [tok.apply_chat_template(
            c, add_generation_prompt=True, tokenize=True, return_dict=False) for c in chats]))
    for name, model, prompts in cases:
        engine_err, ref_err = errors(model, [list(p) for p in prompts], args.backend)
        print(f"{name:14} {engine_err:11.2e} {ref_err:13.2e} {engine_err / ref_err:6.2f}")


if __name__ == "__main__":
    main()
