"""bf16 on the CPU with the real model: how far the engine's greedy outputs and logprobs are from
transformers', reported rather than asserted (the tests hold fp32 to parity). SmolLM2-135M-
Instruct cast to bf16, 8 chat prompts, 48 greedy tokens each (ignore_eos). Prints how many
sequences equal transformers' bf16 `generate`, where the others first differ, and the largest
gap between the engine's logprobs and a transformers forward on the same tokens in bf16 and in
fp32, beside transformers' own bf16-vs-fp32 gap; then the same with the LM head in fp32
(EngineConfig(lm_head_dtype=torch.float32)): the gap to the fp32 reference with and without
it, and the memory it takes. Not in CI.

    python bench/bf16_gaps.py
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from rollout import Engine, EngineConfig, SamplingParams  # noqa: E402
from rollout_recipes.run import smollm2  # noqa: E402

QUESTIONS = ["What is 13 + 7?", "Name three primary colours.",
             "Write a Python function that reverses a string.",
             "Repeat exactly: the quick brown fox jumps over the lazy dog.",
             "What is the capital of France?", "Explain recursion in one sentence.",
             "Give me a haiku about rain.", "Is 17 a prime number? Answer yes or no."]
NEW_TOKENS = 48


def token_logprobs(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """log_softmax (fp32) of `model`'s logits at each of `tokens` after `prompt`."""
    logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1]
    return logits.float().log_softmax(-1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]


@torch.inference_mode()
def main() -> None:
    torch.set_num_threads(os.cpu_count())
    fp32, tok = smollm2.load()
    bf16 = smollm2.load()[0].to(torch.bfloat16).eval()
    convs = [[{"role": "system", "content": "You are a helpful assistant."},
              {"role": "user", "content": q}] for q in QUESTIONS]
    for head in (None, torch.float32):
        engine = Engine(bf16, EngineConfig(kv_cache_tokens=4096, max_model_len=512,
                                           max_num_seqs=16, lm_head_dtype=head), tokenizer=tok)
        print(f"\n== lm_head_dtype={head}: the engine holds {engine.memory_held() / 2**20:.1f} "
              f"MiB (weights, derived copies, KV pool)")
        report(engine, bf16, fp32, convs)


def report(engine, bf16, fp32, convs) -> None:
    outs = engine.chat(convs, SamplingParams(temperature=0, max_tokens=NEW_TOKENS,
                                             logprobs=True, ignore_eos=True))
    same, firsts, diffs = 0, [], {"bf16": [], "fp32": [], "hf": []}
    for out in outs:
        prompt, ours = list(out.prompt_token_ids), list(out.samples[0].token_ids)
        theirs = bf16.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS,
                               min_new_tokens=NEW_TOKENS, do_sample=False)[0, len(prompt):]
        theirs = theirs.tolist()
        same += theirs == ours
        firsts.append(next((i for i, (a, b) in enumerate(zip(theirs, ours)) if a != b), None))
        engine_lp = torch.tensor(out.samples[0].logprobs)
        lp16, lp32 = token_logprobs(bf16, prompt, ours), token_logprobs(fp32, prompt, ours)
        for key, diff in (("bf16", lp16 - engine_lp), ("fp32", lp32 - engine_lp),
                          ("hf", lp16 - lp32)):
            diffs[key].append(diff.abs())
    print(f"bf16 greedy, {len(convs)} chat prompts x {NEW_TOKENS} tokens: {same}/{len(convs)} "
          f"equal to transformers' bf16 generate; first difference at {firsts}")
    gaps = {k: torch.cat(v) for k, v in diffs.items()}
    print("|engine logprob - transformers forward| (mean / max): "
          f"bf16 {gaps['bf16'].mean():.4f} / {gaps['bf16'].max():.3g}, "
          f"fp32 {gaps['fp32'].mean():.4f} / {gaps['fp32'].max():.3g}; "
          f"transformers bf16 vs its own fp32: {gaps['hf'].mean():.4f} / {gaps['hf'].max():.3g}")


if __name__ == "__main__":
    main()
