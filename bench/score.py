"""Engine.score against a transformers forward on the real model: the reference-model pass of
a GRPO step (the logprobs of every completion given its prompt). SmolLM2-135M-Instruct, fp32,
8 chat prompts x n sampled completions; transformers runs the padded batch of prompt +
completion rows (as TRL's reference forward does), the engine `score(start=len(prompt))` right
after the rollout (the prompts cached, the usual case) and on a cold engine (shared prompts
computed once). Interleaved, best of N; prints seconds, the ratio and the largest logprob gap.
Not in CI.

    python bench/score.py [--n 8] [--max-tokens 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]
from workloads import CHAT_QUESTIONS, cpu_name  # noqa: E402
from rollout import Engine, EngineConfig, SamplingParams  # noqa: E402
from rollout_recipes.run import smollm2  # noqa: E402


@torch.inference_mode()
def hf_logprobs(model, prompts, completions, pad: int) -> list[list[float]]:
    """One padded batch (right padding), logprobs of each completion's tokens."""
    rows = [p + c for p, c in zip(prompts, completions)]
    width = max(map(len, rows))
    ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    logp = model(ids, attention_mask=mask).logits.float().log_softmax(-1)
    return [logp[i, len(p) - 1:len(p) + len(c) - 1].gather(-1, torch.tensor(c)[:, None])[:, 0]
            .tolist() for i, (p, c) in enumerate(zip(prompts, completions))]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count())
    model, tok = smollm2.load()
    model.eval()
    config = EngineConfig(kv_cache_tokens=16384, max_model_len=512, max_num_seqs=128)
    engine = Engine(model, config, tokenizer=tok)
    convs = [[{"role": "user", "content": q}] for q in CHAT_QUESTIONS]
    outs = engine.chat(convs, SamplingParams(n=args.n, temperature=1.0, seed=0,
                                             max_tokens=args.max_tokens))
    prompts = [list(o.prompt_token_ids) for o in outs for _ in o.samples]
    completions = [list(s.token_ids) for o in outs for s in o.samples]
    sequences = [p + c for p, c in zip(prompts, completions)]
    starts = [len(p) for p in prompts]
    print(f"{cpu_name()}, {os.cpu_count()} threads, torch "
          f"{torch.__version__}; {len(sequences)} sequences, {sum(map(len, completions))} "
          f"completion tokens, prompts {min(starts)}-{max(starts)} tokens")
    best = {"transformers": float("inf"), "score (prompts cached)": float("inf"),
            "score (cold engine)": float("inf")}
    results = {}
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        results["transformers"] = hf_logprobs(model, prompts, completions, tok.pad_token_id or 0)
        best["transformers"] = min(best["transformers"], time.perf_counter() - t0)
        # Warm: the rollout just cached the prompts (rerun the rollout's admission: score the
        # prompts first so the tree holds them however the last repeat left it).
        engine.score([p + [c[0]] for p, c in zip(prompts, completions)], start=[len(p) + 1
                     for p in prompts])
        t0 = time.perf_counter()
        results["score (prompts cached)"] = [o.logprobs for o in
                                             engine.score(sequences, start=starts)]
        best["score (prompts cached)"] = min(best["score (prompts cached)"],
                                             time.perf_counter() - t0)
        cold = Engine(model, config, tokenizer=tok)
        t0 = time.perf_counter()
        results["score (cold engine)"] = [o.logprobs for o in cold.score(sequences, start=starts)]
        best["score (cold engine)"] = min(best["score (cold engine)"], time.perf_counter() - t0)
        computed = cold.stats.score_tokens_computed
        del cold
    ref = results["transformers"]
    for name, seconds in best.items():
        gap = max(abs(a - b) for x, y in zip(results[name], ref) for a, b in zip(x, y))
        print(f"{name:24s} {seconds:7.3f} s  {best['transformers'] / seconds:5.2f}x "
              f"transformers   max |logprob gap| to transformers {gap:.2e}")
    print(f"cold engine: {computed} positions run for {sum(map(len, sequences)) - len(sequences)}"
          f" in the sequences")


if __name__ == "__main__":
    main()
