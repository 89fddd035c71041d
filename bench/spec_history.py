"""Drafting from history on the real RL loop: the SmolLM2 recipe (recipes/smollm2_arith.py,
real GRPO updates between steps) over a fixed set of prompts, so that every step is one more
epoch over the same questions, with speculation off, n-gram only and "suffix" (n-gram plus the
history of earlier steps' samples). Per step: rollout tokens/s, the speculation acceptance per
draft source, and whether the three runs generated the same tokens (every sample's token ids,
compared; coupled acceptance never changes an output, so the runs train alike). Runs are
interleaved over --repeats; the best tokens/s of each step is kept. Not in CI.

    python bench/spec_history.py [--steps 3] [--prompts 8] [--max-new-tokens 48] [--repeats 1]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from unittest import mock

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]
from workloads import cpu_name  # noqa: E402

SPECS = {"off": None, "ngram": "{method: ngram, num_speculative_tokens: 5}",
         "suffix": "{method: suffix, num_speculative_tokens: 5, adaptive: true}"}


def sums(path: str, rows: int) -> str:
    with open(path, "w") as f:
        for i in range(rows):
            a, b = 3 + 2 * i, 1 + i % 9
            f.write(json.dumps({"a": a, "b": b, "answer": str(a + b)}) + "\n")
    return path


def run(name: str, args, data: str, out_dir: str) -> tuple[list[dict], list[list]]:
    """The recipe's history, a row a step, and each step's samples' token ids (its one
    Engine.generate call: no held-out evaluation runs)."""
    from rollout import Engine
    from rollout_recipes import smollm2_arith

    tokens, generate = [], Engine.generate

    def recording(engine, *a, **kw):
        outs = generate(engine, *a, **kw)
        tokens.append([s.token_ids for out in outs for s in out.samples])
        return outs

    argv = ["--dataset", data, "--steps", str(args.steps), "--prompts_per_step",
            str(args.prompts), "--eval_size", "0", "--eval_every", "0",
            "--max_new_tokens", str(args.max_new_tokens), "--system_prompt", args.system,
            "--output_dir", os.path.join(out_dir, name), "--plot", "false"]
    if SPECS[name]:
        argv += ["--speculative", SPECS[name]]
    with mock.patch.object(Engine, "generate", recording):
        history = smollm2_arith.main(argv)["history"]
    assert len(tokens) == len(history), f"{len(tokens)} generate calls in {len(history)} steps"
    return history, tokens


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--system", default="Think step by step, then give the number.")
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    best: dict[str, list[float]] = {}
    rows: dict[str, list[dict]] = {}
    tokens: dict[str, list[list]] = {}
    with tempfile.TemporaryDirectory(prefix="spec_history_") as out_dir:
        data = sums(os.path.join(out_dir, "sums.jsonl"), args.prompts)
        for _ in range(args.repeats):
            for name in SPECS:
                rows[name], tokens[name] = run(name, args, data, out_dir)
                speeds = [h["rollout/tokens_per_second"] for h in rows[name]]
                best[name] = [max(a, b) for a, b in zip(best.get(name, speeds), speeds)]
    print(f"# {cpu_name()}; SmolLM2-135M, {args.prompts} prompts x 8 samples a step (each step "
          f"an epoch), max_new_tokens {args.max_new_tokens}, best of {args.repeats}")
    print("| step | off tok/s | ngram tok/s | suffix tok/s | suffix / off | suffix / ngram "
          "| history acceptance | same tokens |")
    print("|---|---|---|---|---|---|---|---|")
    for step in range(args.steps):
        off, ngram, suffix = (best[n][step] for n in SPECS)
        h = rows["suffix"][step]
        same = all(tokens[n][step] == tokens["off"][step] for n in SPECS)
        acc = h.get("rollout/spec_acceptance/history")
        print(f"| {step + 1} | {off:.1f} | {ngram:.1f} | {suffix:.1f} | {suffix / off:.2f}x | "
              f"{suffix / ngram:.2f}x | {'-' if acc is None else f'{acc:.2f}'} | {same} |")


if __name__ == "__main__":
    main()
