"""The reward curve as a PNG: what a person looks at first to see whether the run learned.

Two series on one [0, 1] axis: the mean reward of each step's samples (temperature > 0, so it
sits below what the policy can do greedily) and the held-out greedy accuracy, from the score
before RL (step 0) through each `eval_every` evaluation to the final one. Below it, where the
run logged them, the rollout-vs-trainer mismatch of each step (the mean logprob gap, and the
importance ratio's distance from 1 at its extremes): what shows a stale or broken sync."""

from __future__ import annotations

import os


def reward_curve(history: list[dict], path: str, title: str, accuracy: dict | None = None
                 ) -> str:
    import matplotlib

    matplotlib.use("Agg")  # no display on training machines
    import matplotlib.pyplot as plt

    rows = [r for r in history if "reward/mean" in r]
    steps = [r["step"] for r in rows]
    reward = [r["reward/mean"] for r in rows]
    mismatch = [r for r in rows if "mismatch/logprob_gap_mean" in r]
    if mismatch:
        fig, (ax, low) = plt.subplots(2, 1, figsize=(7, 6), dpi=120, sharex=True,
                                      gridspec_kw={"height_ratios": [2, 1]})
        _mismatch_panel(low, mismatch)
    else:
        fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    ax.plot(steps, reward, color="tab:blue", alpha=0.3, label="reward per step (sampled)")
    window = max(1, len(reward) // 15)
    if window > 1:
        ax.plot(steps, moving_mean(reward, window), color="tab:blue",
                label=f"reward, moving mean of {window} steps")
    evals = [(0, accuracy["before"])] if accuracy and accuracy.get("before") is not None else []
    evals += [(r["step"], r["eval/accuracy"]) for r in history if "eval/accuracy" in r]
    if not any(r.get("eval/accuracy") is not None for r in history) and accuracy \
            and accuracy.get("after") is not None:
        evals.append((steps[-1] if steps else 1, accuracy["after"]))
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
    steps = [r["step"] for r in rows]
    ax.semilogy(steps, [max(r["mismatch/logprob_gap_mean"], 1e-12) for r in rows],
                color="tab:red", label="logprob gap, mean (rollout vs trainer)")
    ax.semilogy(steps, [max(abs(r["mismatch/ratio_max"] - 1), abs(r["mismatch/ratio_min"] - 1),
                            1e-12) for r in rows],
                color="tab:orange", label="importance ratio, max |r - 1|")
    ax.set_xlabel("step")
    ax.legend(loc="upper left", fontsize=7)


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
