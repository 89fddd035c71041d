"""Multi-turn episodes: what the prefix cache saves across turns, and stragglers.

64 episodes (16 prompts x n=4), 4 model turns each, 40-token observations, on a random-weight
~25M Qwen2-style model with a character tokenizer. Prints:
  (1) prompt tokens each later turn computed vs the episode's length so far (the goal: only the
      observation + 1 token computed, >= 95 % of each turn's prompt from the cache);
  (2) wall time of run_episodes vs the same turns as turn-synchronous generate() calls on
      re-tokenised text (every episode's turn t in one batch, the history decoded and encoded
      again each turn);
  (3) a straggler: one environment step sleeps 2 s; the time the other episodes take to
      finish, with and without it.
Best of --repeat runs, systems interleaved. Nothing asserted.

    python bench/multi_turn.py
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from workloads import QWEN2_25M, random_qwen2  # noqa: E402

from rollout_recipes.run.tiny import char_tokenizer  # noqa: E402
from rollout import Engine, EngineConfig, SamplingParams  # noqa: E402
from rollout.agent import Step, run_episodes  # noqa: E402

ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789 +=.,\n<>/"
TURNS, OBS_LEN, N = 4, 40, 4


def observation(rng: random.Random) -> str:
    return "<r>" + "".join(rng.choice("0123456789 ") for _ in range(OBS_LEN - 8)) + "</r>\n"


class Env:
    """Fixed-length observations; done after TURNS model turns. `slow`: (episode, seconds)."""

    slow: tuple[int, float] | None = None
    made = 0
    finished: list[float] = []

    def __init__(self) -> None:
        self.index, Env.made = Env.made, Env.made + 1
        self.rng, self.turn = random.Random(self.index), 0

    def step(self, turn_ids, text):
        self.turn += 1
        if Env.slow and Env.slow[0] == self.index and self.turn == 1:
            time.sleep(Env.slow[1])
        if self.turn >= TURNS:
            Env.finished.append(time.perf_counter())
            return Step(done=True)
        return Step(observation=observation(self.rng))


def fresh(model, tok) -> Engine:
    return Engine(model, EngineConfig(kv_cache_tokens=65536, max_model_len=1024), tokenizer=tok)


def run_agent(model, tok, prompts, params, slow=None):
    Env.made, Env.slow, Env.finished = 0, slow, []
    engine = fresh(model, tok)
    t0 = time.perf_counter()
    episodes = run_episodes(engine, prompts, Env, params, max_turns=TURNS, env_workers=16)
    wall = time.perf_counter() - t0
    others = sorted(Env.finished)[-2 if slow else -1] - t0  # last episode but the straggler
    return engine, episodes, wall, others


def run_resync(model, tok, prompts, params):
    """Every episode's turn t in one generate() call, the history re-tokenised from text."""
    engine = fresh(model, tok)
    rngs = [random.Random(i) for i in range(len(prompts) * N)]
    texts = [p for p in prompts for _ in range(N)]
    t0 = time.perf_counter()
    for turn in range(TURNS):
        sp = [SamplingParams(temperature=1.0, max_tokens=params.max_tokens, seed=i * 97 + turn,
                             stop=params.stop) for i in range(len(texts))]
        outs = engine.generate(texts, sp)
        texts = [t + o.samples[0].text for t, o in zip(texts, outs)]
        if turn < TURNS - 1:
            texts = [t + observation(rng) for t, rng in zip(texts, rngs)]
    return engine, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tok = char_tokenizer(ALPHABET)
    model = random_qwen2(dict(QWEN2_25M, vocab_size=len(tok)))
    rng = random.Random(0)
    system = "".join(rng.choice(ALPHABET[:27]) for _ in range(200))
    prompts = [system + f" task {i}: " for i in range(args.prompts)]
    params = SamplingParams(n=N, temperature=1.0, max_tokens=args.max_tokens, seed=0,
                            stop=["</c>"])
    best = {}
    for _ in range(args.repeat):
        engine, episodes, wall, _ = run_agent(model, tok, prompts, params)
        best["agent"] = min(best.get("agent", wall), wall)
        _, resync = run_resync(model, tok, prompts, params)
        best["resync"] = min(best.get("resync", resync), resync)
    eps = [e for row in episodes for e in row]
    st = engine.stats
    # The first turns alone (same seeds, so the same first turns): what later turns add.
    Env.made, Env.slow = 0, None
    first = fresh(model, tok)
    run_episodes(first, prompts, Env, params, max_turns=1, env_workers=16)
    later_prompt = st.prompt_tokens - first.stats.prompt_tokens
    later_computed = st.prompt_tokens_computed - first.stats.prompt_tokens_computed
    later_turns = sum(e.turns - 1 for e in eps)
    print(f"{len(eps)} episodes x {TURNS} turns, {OBS_LEN}-token observations")
    print(f"(1) later turns: {later_turns} turns, {later_prompt} prompt tokens, {later_computed} "
          f"computed ({later_computed / later_turns:.1f} per turn; observation + 1 = "
          f"{OBS_LEN + 1}): {1 - later_computed / later_prompt:.1%} from the cache; holds "
          f"dropped {st.holds_dropped}")
    print(f"(2) run_episodes {best['agent']:.2f} s vs turn-synchronous re-tokenised generate "
          f"{best['resync']:.2f} s: {best['resync'] / best['agent']:.2f}x")
    base = min(run_agent(model, tok, prompts, params)[3] for _ in range(args.repeat))
    slow = min(run_agent(model, tok, prompts, params, slow=(5, 2.0))[3]
               for _ in range(args.repeat))
    print(f"(3) the other episodes finish in {base:.2f} s alone, {slow:.2f} s beside a "
          f"2 s straggler ({slow / base:.2f}x)")


if __name__ == "__main__":
    main()
