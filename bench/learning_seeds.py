"""The seed noise behind tests/integrations/test_learning.py's margins: its runs, seed by seed.
Not in CI (two minutes a run on a 2-core CPU).

A run's held-out gain is a single draw: RL's trajectory is chaotic, so any change of bits (a
seed, a code change, or what ran before in the same process: seed 0's partial run gains +7.8
points alone and +3.6 after the synchronous run in one pytest process) gives another draw of it.
A margin is therefore set from the spread of many draws, and each draw here runs in a fresh
process (`--one`), which makes a seed's figure reproducible on one machine. Reported per
configuration: the gain of each seed (held-out greedy accuracy after minus before, points),
mean, standard deviation and lowest; engine steps and rollout seconds per optimizer step.

Configurations are the test's settings: `grpo`, `ppo` (the addition task, from the demo's warm
start), `reverse` and `reverse-partial` (the reversal task, from its warm start; the second
with partial rollouts). The warm starts come from the test's cache (built when missing).

    python bench/learning_seeds.py [--configs reverse reverse-partial] [--seeds 0-6] [--jobs 2]
        [--set steps=20 prompts_per_step=32]   # settings other than the test's

With `--set eval_every=K` each run also scores the held-out set every K steps, and the gains
are reported at each of those steps too: one sweep gives the spread of every shorter run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests", "integrations"))
import test_learning as t  # noqa: E402  (the settings measured are the test's own)
from workloads import cpu_name  # noqa: E402

CONFIGS = {
    "grpo": (t.WARM_START, t.GRPO),
    "ppo": (t.WARM_START, t.PPO),
    "reverse": (t.REVERSE_WARM_START, t.REVERSE),
    "reverse-partial": (t.REVERSE_WARM_START, dict(t.REVERSE, **t.PARTIAL)),
}


def one(config: str, seed: int, changes: dict) -> dict:
    """One run in this process: what the test reads from it."""
    os.environ["WANDB_MODE"] = "disabled"
    warm, settings = CONFIGS[config]
    settings = dict(settings, seed=seed, **changes)
    with tempfile.TemporaryDirectory() as out_dir:
        out = t.run(t.cached_warm_start(warm), out_dir, settings)
    history = out["history"]
    curve = {str(step): row["eval/accuracy"] - out["accuracy_before"]
             for step, row in enumerate(history, 1) if "eval/accuracy" in row}
    return dict(config=config, seed=seed, gain=out["accuracy_after"] - out["accuracy_before"],
                before=out["accuracy_before"], curve=curve,
                engine_steps=sum(row["rollout/engine_steps"] for row in history) / len(history),
                rollout_s=sum(row["time/rollout"] for row in history) / len(history))


def spawn(config: str, seed: int, changes: list[str]) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--one", config, str(seed),
                           "--set", *changes], capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode or not lines:
        raise RuntimeError(f"{config} seed {seed} failed:\n{proc.stdout}\n{proc.stderr}")
    return json.loads(lines[-1])


def seeds(text: str) -> list[int]:
    first, _, last = text.partition("-")
    return list(range(int(first), int(last or first) + 1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", nargs="+", choices=sorted(CONFIGS),
                    default=["reverse", "reverse-partial"])
    ap.add_argument("--seeds", type=seeds, default=seeds("0-6"), help="first-last, e.g. 0-6")
    ap.add_argument("--jobs", type=int, default=2, help="runs at a time (each one thread)")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=INT",
                    help="integer settings other than the test's, e.g. steps=20")
    ap.add_argument("--one", nargs=2, metavar=("CONFIG", "SEED"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        changes = {k: int(v) for k, v in (item.split("=", 1) for item in args.set)}
        print(json.dumps(one(args.one[0], int(args.one[1]), changes)))
        return
    # Build each warm start once, before runs that would race to build it.
    for config in args.configs:
        t.cached_warm_start(CONFIGS[config][0])
    print(f"# {cpu_name()}, {args.jobs} runs at a time, seeds {args.seeds[0]}-{args.seeds[-1]}"
          + (f", {' '.join(args.set)}" if args.set else ""))
    # Interleaved, so that the machine's load falls on every configuration alike.
    work = [(config, seed) for seed in args.seeds for config in args.configs]
    with ThreadPoolExecutor(args.jobs) as pool:
        results = list(pool.map(lambda job: spawn(*job, args.set), work))
    for config in args.configs:
        rows = [r for r in results if r["config"] == config]
        print(f"{config}: from {rows[0]['before']:.1%}, gains {spread(r['gain'] for r in rows)};"
              f" engine steps / step {statistics.mean(r['engine_steps'] for r in rows):.1f},"
              f" rollout s / step {statistics.mean(r['rollout_s'] for r in rows):.2f}")
        for step in rows[0]["curve"]:
            print(f"  after {step} steps: {spread(r['curve'][step] for r in rows)}")


def spread(gains) -> str:
    """Each seed's gain in points, then their mean, standard deviation and lowest."""
    gains = [100 * g for g in gains]
    sd = statistics.stdev(gains) if len(gains) > 1 else 0.0
    return (", ".join(f"{g:+.1f}" for g in gains)
            + f"; mean {statistics.mean(gains):+.1f}, sd {sd:.1f}, lowest {min(gains):+.1f}")


if __name__ == "__main__":
    main()
