"""The host's time for drafting from history (rollout/spec/history.py): a step's lookups, each
decoding sample's longest suffix match in the history and the draft continuing it, against the
n-gram search over the sample's own tokens and its siblings' that the suffix drafter runs first
(rollout/spec/ngram.py), on the same contexts in the same run.

The history is `--epochs` epochs of `--prompts` prompts x `--n` samples, Zipf-distributed token
ids of SmolLM2's vocabulary (a frequent id occurs in hundreds of places, as in real text); the
contexts are those prompts with a fresh completion under way. On a GPU a decode step of a small
model takes a few ms, so tens of us a sample is a share of it worth knowing. Nothing asserted.

    python bench/history_lookup.py [--epochs 3] [--prompts 8] [--n 8] [--repeat 7]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from rollout.spec.history import DraftHistory  # noqa: E402
from rollout.spec.ngram import NgramDrafter  # noqa: E402

VOCAB = 49152  # SmolLM2's


class Seq:
    """What NgramDrafter.search reads of a sample."""

    def __init__(self, seq_id: int, prompt: list[int], output: list[int]) -> None:
        self.seq_id, self.prompt_ids, self.token_ids = seq_id, prompt, prompt + output
        self.num_prompt = len(prompt)


def zipf(rng, count: int) -> list[int]:
    return np.minimum(rng.zipf(1.2, count), VOCAB - 1).tolist()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=300)
    ap.add_argument("--completion-len", type=int, default=64)
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    prompts = [zipf(rng, args.prompt_len) for _ in range(args.prompts)]
    history = DraftHistory(1 << 20, 1, 32)  # SpeculativeConfig's defaults
    for _ in range(args.epochs):
        for prompt in prompts:
            for _ in range(args.n):
                history.add(prompt, zipf(rng, args.completion_len))
    groups = [[Seq(i * args.n + j, p, zipf(rng, args.completion_len // 2))
               for j in range(args.n)] for i, p in enumerate(prompts)]
    samples = [s for g in groups for s in g]
    ngram = NgramDrafter(1, 4)

    def history_step() -> None:
        for s in samples:
            length, positions = history.matches(s.token_ids, s.prompt_ids)
            if length:
                history.continuation(positions, args.k, 0.3)

    def ngram_step() -> None:
        hays = {}
        for group in groups:
            for s in group:
                ngram.search(s, [o for o in group if o is not s], args.k, hays)

    best = {"history": float("inf"), "ngram": float("inf")}
    for _ in range(args.repeat):  # interleaved: the host is shared and noisy
        for name, step in (("history", history_step), ("ngram", ngram_step)):
            t0 = time.perf_counter()
            step()
            best[name] = min(best[name], time.perf_counter() - t0)
    us = {name: t / len(samples) * 1e6 for name, t in best.items()}
    print(f"{len(samples)} decoding samples, history of {history.tokens} tokens "
          f"({len(history.entries)} entries), best of {args.repeat}")
    print(f"history lookup: {us['history']:.1f} us a sample, {best['history'] * 1e3:.2f} ms "
          f"a step; n-gram search: {us['ngram']:.1f} us a sample; "
          f"history / n-gram {us['history'] / us['ngram']:.2f}x")


if __name__ == "__main__":
    main()
