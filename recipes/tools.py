"""`python -m rollout_recipes.tools`: GRPO on multi-turn episodes with a tool, against the same budget
without it, on the CPU (its run time is in docs/benchmarks.md).

The tiny Llama and character tokenizer of the demo, on 3-4 digit sums (recipes/tasks/
calculator.py): too hard to learn to add in minutes, easy with a calculator. The tool run
warm-starts on 1024 demonstrations of the protocol ("<c>1234+567</c>", the environment's
"<r>1801</r>" as untrained context, then "1801" and EOS), then runs GRPO on episodes rolled
out by rollout.agent.run_episodes (later turns served by the prefix cache), trained on the
episodes' mask (recipes/algo/batch.py). The baseline (`tools: false`) warm-starts on the same
examples' bare answers and runs the same GRPO budget single-turn. Both runs are scored greedily
on the same held-out sums before and after GRPO.

    python -m rollout_recipes.tools [--key value ...]          # both runs; overrides of configs/tools.yaml
    python -m rollout_recipes.tools --tools false              # one of them
    python recipes/grpo.py --config recipes/configs/tools.yaml [--algo ppo]   # launchable

Outputs, per run under outputs/tools/{tool,no_tool}/: reward_curve.png, metrics.jsonl, an
offline W&B run; outputs/tools/comparison.png holds both held-out curves.
"""

from __future__ import annotations

import os

CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "tools.yaml")
RUNS = {True: "tool", False: "no_tool"}
LABELS = {"tool": "with the tool (multi-turn)", "no_tool": "without it (single-turn)"}


def main(argv: list[str] | None = None) -> dict:
    os.environ.setdefault("WANDB_SILENT", "true")
    from rollout_recipes.run.config_file import command_line_overrides, load_config
    from rollout_recipes.run.plot import accuracy_curves
    from rollout_recipes.run.session import train

    overrides = command_line_overrides(__doc__, argv)
    base = load_config(CONFIG, overrides)  # checks every key before anything is built
    variants = [base.tools] if "tools" in overrides else [True, False]
    results: dict[str, dict] = {}
    for tools in variants:
        name = RUNS[tools]
        cfg = load_config(CONFIG, {**overrides, "tools": tools,
                                   "output_dir": os.path.join(base.output_dir, name),
                                   "run_name": f"{base.run_name or 'tools'}-{name}"})
        if cfg.progress:
            print(f"\n=== {LABELS[name]} ===", flush=True)
        results[name] = train(cfg)
    if base.plot and len(results) > 1:
        results["comparison_plot"] = accuracy_curves(
            {LABELS[k]: (r["history"], r.get("accuracy_before")) for k, r in results.items()},
            os.path.join(base.output_dir, "comparison.png"),
            title=f"{base.algo.upper()} on 3-4 digit sums, with and without a calculator")
    print(report(results))
    return results


def report(results: dict) -> str:
    lines = ["", "=" * 72, "held-out greedy accuracy (sums never trained on), before -> after "
             "GRPO:"]
    for name, label in LABELS.items():
        r = results.get(name)
        if r and r.get("accuracy_before") is not None and r.get("accuracy_after") is not None:
            lines.append(f"  {label:<28} {r['accuracy_before']:6.1%} -> "
                         f"{r['accuracy_after']:6.1%}   ({r['seconds']:.0f} s)")
    tool = results.get("tool")
    if tool:
        stats = tool.get("engine_stats") or {}
        hit = stats.get("prompt_hit_tokens", 0) / max(stats.get("prompt_tokens", 0), 1)
        lines.append(f"tool run's engine: {hit:.0%} of all prompt tokens (every turn, n per "
                     f"prompt) served from the radix cache, {stats.get('holds_dropped', 0)} "
                     f"held episodes dropped, {stats.get('preemptions', 0)} preemptions")
        later = tool.get("later_turn_cache")
        if later and later["later_turns"]:
            lines.append(
                f"later turns (greedy held-out episodes): {later['later_turns']} turns, "
                f"{later['prompt_tokens']} prompt tokens, {later['computed']} computed "
                f"({later['computed'] / later['later_turns']:.1f} per turn; its observation + 1 "
                f"= {(later['env_tokens'] + later['later_turns']) / later['later_turns']:.1f}): "
                f"{later['hit_rate']:.1%} from the cache")
    for name in LABELS:
        if results.get(name):
            r = results[name]
            lines.append(f"{name}: {r.get('plot')}, {r.get('metrics_path')}"
                         + (f", W&B {r['wandb_dir']}" if r.get("wandb_dir") else ""))
    if results.get("comparison_plot"):
        lines.append(f"both: {results['comparison_plot']}")
    lines.append("=" * 72)
    return "\n".join(lines)


if __name__ == "__main__":
    main()
