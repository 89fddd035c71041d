"""The reward curve as a PNG: what a person looks at first to see whether the run learned.

Two series on one [0, 1] axis: the mean reward of each step's samples (temperature > 0, so it
sits below what the policy can do greedily) and the held-out greedy accuracy, from the score
before RL (step 0) through each `eval_every` evaluation to the final one. Below it, where the
run logged them, the rollout-vs-trainer mismatch of each step (the mean logprob gap, and the
importance ratio's distance from 1 at its extremes): what shows a stale or broken sync.
Non-finite values (a ratio past float range, an accuracy of nothing) are no points: the
mismatch panel marks their steps with a vertical line instead."""

from __future__ import annotations

import math
import os


def reward_curve(history: list[dict], path: str, title: str, accuracy: dict | None = None
                 ) -> str:
    import matplotlib

    matplotlib.use("Agg")  # no display on training machines
    import matplotlib.pyplot as plt

    rows = [r for r in history if "reward/mean" in r]
    steps = [r["step"] for r in rows]  # the x range, whatever the values
    points = _finite((r["step"], r["reward/mean"]) for r in rows)
    reward = [y for _, y in points]
    mismatch = [r for r in rows if "mismatch/logprob_gap_mean" in r]
    if mismatch:
        fig, (ax, low) = plt.subplots(2, 1, figsize=(7, 6), dpi=120, sharex=True,
                                      gridspec_kw={"height_ratios": [2, 1]})
        _mismatch_panel(low, mismatch)
    else:
        fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    ax.plot([x for x, _ in points], reward, color="tab:blue", alpha=0.3,
            label="reward per step (sampled)")
    window = max(1, len(reward) // 15)
    if window > 1:
        ax.plot([x for x, _ in points], moving_mean(reward, window), color="tab:blue",
                label=f"reward, moving mean of {window} steps")
    evals = [(0, accuracy["before"])] if accuracy and accuracy.get("before") is not None else []
    evals += [(r["step"], r["eval/accuracy"]) for r in history if "eval/accuracy" in r]
    if not any(r.get("eval/accuracy") is not None for r in history) and accuracy \
            and accuracy.get("after") is not None:
        evals.append((steps[-1] if steps else 1, accuracy["after"]))
    evals = _finite(evals)
    if evals:
        ax.plot(*zip(*evals), color="tab:green", marker="o", markersize=4,
                label="held-out accuracy (greedy)")
        ax.annotate(f"{evals[0][1]:.0%}", evals[0], textcoords="offset points",
                    xytext=(4, -12), color="tab:green", fontsize=8)
        ax.annotate(f"{evals[-1][1]:.0%}", evals[-1], textcoords="offset points",
                    xytext=(-10, 6), color="tab:green", fontsize=8)
    ax.set_title(title)
    ax.legend(loc="upper left", fontsize=8)
    return _save(fig, ax, path)


def _mismatch_panel(ax, rows: list[dict]) -> None:
    gap = [(r["step"], max(r["mismatch/logprob_gap_mean"], 1e-12)) for r in rows]
    ratio = [(r["step"], max(abs(r["mismatch/ratio_max"] - 1), abs(r["mismatch/ratio_min"] - 1),
                             1e-12)) for r in rows]
    for series, color, label in ((gap, "tab:red", "logprob gap, mean (rollout vs trainer)"),
                                 (ratio, "tab:orange", "importance ratio, max |r - 1|")):
        finite = _finite(series)
        ax.semilogy([x for x, _ in finite], [y for _, y in finite], color=color, label=label)
    # The worst mismatch overflows (a ratio of inf): the step is marked, not dropped unseen.
    off_scale = sorted({x for x, y in gap + ratio if not math.isfinite(y)})
    for k, step in enumerate(off_scale):
        ax.axvline(step, color="tab:red", linestyle=":",
                   label=None if k else "mismatch not finite")
    ax.set_xlabel("step")
    ax.legend(loc="upper left", fontsize=7)


def _finite(points) -> list[tuple]:
    """(x, y) points whose y is a finite number (not inf, NaN or None)."""
    return [(x, y) for x, y in points if isinstance(y, (int, float)) and math.isfinite(y)]


def moving_mean(xs: list[float], window: int) -> list[float]:
    out = []
    for i in range(len(xs)):
        chunk = xs[max(0, i - window + 1):i + 1]
        out.append(sum(chunk) / len(chunk))
    return out


def accuracy_curves(runs: dict[str, tuple[list[dict], float | None]], path: str,
                    title: str) -> str:
    """Held-out accuracy of several runs on one axis: label -> (history, accuracy before RL);
    with each run's sampled reward per step, faint."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    for k, (label, (history, before)) in enumerate(runs.items()):
        color = f"C{k}"
        rows = [r for r in history if "reward/mean" in r]
        ax.plot([r["step"] for r in rows], [r["reward/mean"] for r in rows], color=color,
                alpha=0.25, label=f"{label}: reward per step (sampled)")
        evals = [(0, before)] if before is not None else []
        evals += [(r["step"], r["eval/accuracy"]) for r in history if "eval/accuracy" in r]
        if evals:
            ax.plot(*zip(*evals), color=color, marker="o", markersize=4,
                    label=f"{label}: held-out accuracy (greedy)")
            ax.annotate(f"{evals[-1][1]:.0%}", evals[-1], textcoords="offset points",
                        xytext=(-10, 6), color=color, fontsize=8)
    ax.set_title(title, fontsize=10)
    ax.legend(loc="center right", fontsize=7)
    return _save(fig, ax, path)


def _save(fig, ax, path: str) -> str:
    """The axes every recipe plot shares (RL steps against a 0-1 reward or accuracy), then the
    PNG."""
    import matplotlib.pyplot as plt

    ax.set_xlabel("RL step")
    ax.set_ylabel("reward / accuracy")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
