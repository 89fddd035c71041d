"""LoRA served unmerged against the merged path, on SmolLM2-135M-Instruct with a PEFT adapter of
rank --rank on every projection (q, k, v, o, gate, up, down), B random (a trained adapter's
scale, not PEFT's zeros). Not in CI.

- sync: update_weights(peft_model) after a simulated optimizer step (every LoRA weight moved):
  the unmerged engine copies the adapter (A and B), the merged one every weight with the
  adapter folded in. Bytes and seconds, engines interleaved, best of --repeats.
- decode: whole engine steps of --prompts x --n samples decoding side by side (prompts cached),
  the unmerged LoRA engine against an engine on the plain model (the adapter's cost on top of
  the base), alternating step by step; median of --steps steps each.
- bf16: the same sampled completions scored by an unmerged and a merged bf16 engine against
  PEFT's own bf16 forward (adapters kept float32, PEFT's default): mean and max |logprob gap|.

    python bench/lora.py [--rank 16] [--repeats 5] [--prompts 8] [--n 8] [--steps 30]
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]
from workloads import CHAT_QUESTIONS, cpu_name  # noqa: E402
from rollout import Engine, EngineConfig, SamplingParams  # noqa: E402
from rollout_recipes.run import smollm2  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
def peft_model(base, rank: int, seed: int = 0):
    import peft

    model = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(
        r=rank, lora_alpha=2 * rank, target_modules=TARGETS, lora_dropout=0.0))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    return model.eval()


def optimizer_step(model, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.add_(torch.randn(p.shape, generator=gen) * 1e-4)


def sync(model, tok, config, repeats: int) -> dict:
    engines = {mode: Engine(model, EngineConfig(lora=mode, **config), tokenizer=tok)
               for mode in ("unmerged", "merged")}
    seconds = {mode: [] for mode in engines}
    sent = {}
    for i in range(repeats):
        optimizer_step(model, i)
        for mode, engine in engines.items():
            result = engine.update_weights(model)
            seconds[mode].append(result["seconds"])
            sent[mode] = result["bytes"]
    return {mode: (sent[mode], min(seconds[mode])) for mode in engines}


def decode(base, model, tok, config, prompts, n: int, steps: int) -> dict:
    engines = {"plain": Engine(base, EngineConfig(**config), tokenizer=tok),
               "lora": Engine(model, EngineConfig(**config), tokenizer=tok)}
    params = SamplingParams(n=n, temperature=1.0, max_tokens=10**6, ignore_eos=True, seed=0)
    for engine in engines.values():
        for p in prompts:
            engine.add_request(p, params)
        while (len(engine.scheduler.running) < len(prompts) * n
               or any(len(s.token_ids) == s.num_prompt for s in engine.scheduler.running)):
            engine.step()  # every prompt prefilled, every sample decoding
        for _ in range(3):
            engine.step()  # warm
    times = {name: [] for name in engines}
    for _ in range(steps):
        for name, engine in engines.items():
            t0 = time.perf_counter()
            engine.step()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in times.items()}


def bf16_gaps(base, rank: int, tok, config, sequences, starts) -> dict:
    model = peft_model(base, rank).to(torch.bfloat16)
    for name, p in model.named_parameters():
        if "lora_" in name:
            p.data = p.data.float()
    with torch.inference_mode():
        ref = [model(torch.tensor([s])).logits[0, start - 1:-1].float().log_softmax(-1)
               .gather(-1, torch.tensor(s[start:])[:, None])[:, 0]
               for s, start in zip(sequences, starts)]
    ref = torch.cat(ref)
    gaps = {}
    for mode in ("unmerged", "merged"):
        engine = Engine(model, EngineConfig(lora=mode, dtype=torch.bfloat16, **config),
                        tokenizer=tok)
        got = torch.cat([torch.tensor(o.logprobs) for o in engine.score(sequences, start=starts)])
        gap = (got - ref).abs()
        gaps[mode] = (gap.mean().item(), gap.max().item())
    return gaps


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count())
    base, tok = smollm2.load()
    base.eval()
    model = peft_model(base, args.rank)
    adapter = sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)
    print(f"{cpu_name()}, {os.cpu_count()} threads; SmolLM2-135M fp32, LoRA r={args.rank} on "
          f"{len(TARGETS)} projections x 30 layers ({adapter / 1e6:.2f}M adapter parameters)")
    config = dict(kv_cache_tokens=16384, max_model_len=512, max_num_seqs=128)

    (ub, us), (mb, ms) = sync(model, tok, config, args.repeats).values()
    print(f"sync   unmerged {ub / 2**20:7.2f} MiB {us * 1e3:8.1f} ms | merged {mb / 2**20:7.2f} "
          f"MiB {ms * 1e3:8.1f} ms | {mb / ub:5.1f}x fewer bytes, {ms / us:5.1f}x faster "
          f"(best of {args.repeats})")

    texts = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                     add_generation_prompt=True)
             for q in (CHAT_QUESTIONS * args.prompts)[:args.prompts]]
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    step = decode(base, model, tok, config, prompts, args.n, args.steps)
    print(f"decode step ({args.prompts} x {args.n} samples)  plain {step['plain'] * 1e3:.1f} ms"
          f" | LoRA unmerged {step['lora'] * 1e3:.1f} ms | {step['lora'] / step['plain']:.3f}x "
          f"(median of {args.steps}, interleaved; goal <= 1.15x)")

    sampler = Engine(base, EngineConfig(**config), tokenizer=tok)
    outs = sampler.generate(prompts, SamplingParams(n=2, temperature=1.0, max_tokens=64, seed=1))
    sequences = [o.prompt_token_ids + s.token_ids for o in outs for s in o.samples]
    starts = [len(o.prompt_token_ids) for o in outs for _ in o.samples]
    gaps = bf16_gaps(base, args.rank, tok, config, sequences, starts)
    (um, ux), (mm, mx) = gaps.values()
    tokens = sum(len(s) - t for s, t in zip(sequences, starts))
    print(f"bf16 |logprob gap| to PEFT's bf16 forward over {tokens} tokens: unmerged mean "
          f"{um:.4f} max {ux:.3f} | merged mean {mm:.4f} max {mx:.3f}")


if __name__ == "__main__":
    main()
