"""What a step costs this machine, measured: seconds ~ fixed + per_position x positions, fitted
by least squares over the engine's recent steps (forward and sampling; exponentially weighted,
so it follows the batch mix). Adaptive speculation (Speculator._paying) weighs a draft token
against it: a verified position costs per_position, and a token it saves would have cost a
decode step's share, (fixed + per_position x decodes) / decodes. On a CPU a step costs nearly
in proportion to its positions (a verified position about what a decoded one does), on a GPU
nearly nothing per position at rollout batch sizes: one rule drafts little on the first and
long on the second, where a rule of batch size alone cannot know which machine it runs on.

Under tensor parallelism nothing is observed (each rank's clock would give it its own line,
and the ranks must draft alike): the engine keeps the batch-share bar there, and wherever the
drafts shape the outputs (a draft model's under "rejection" acceptance: Speculator._bar), which
must not follow the clock.

A measurement, not engine state: it changes which drafts are proposed, never an output, and a
step that fails is not observed (the engine observes only completed steps), so nothing here is
journaled."""

from __future__ import annotations

# Weight of the steps seen so far against a new one: about the last 50 steps count.
DECAY = 0.98
# Steps observed before the line is trusted, and how far their positions must spread (the
# weighted standard deviation over the mean) to tell the fixed part from the per-position one.
MIN_STEPS = 8
MIN_SPREAD = 0.05


class StepCost:
    def __init__(self) -> None:
        self.steps = 0
        # exponentially weighted sums: weight, positions, seconds, positions^2, positions x seconds
        self._w = self._x = self._y = self._xx = self._xy = 0.0

    def observe(self, positions: int, seconds: float) -> None:
        """One completed step: the positions it ran through the model and its seconds."""
        if positions <= 0 or not seconds > 0:
            return
        self.steps += 1
        d = DECAY
        self._w = d * self._w + 1.0
        self._x = d * self._x + positions
        self._y = d * self._y + seconds
        self._xx = d * self._xx + positions * positions
        self._xy = d * self._xy + positions * seconds

    def line(self) -> tuple[float, float] | None:
        """(fixed seconds, seconds per position), or None while the steps seen cannot separate
        them (too few, or their positions too alike). The per-position part is clamped at 0
        (a GPU's steps can cost alike whatever their size) and the fixed part at 0."""
        if self.steps < MIN_STEPS:
            return None
        mean_x, mean_y = self._x / self._w, self._y / self._w
        var_x = self._xx / self._w - mean_x * mean_x
        if var_x <= (MIN_SPREAD * mean_x) ** 2:
            return None
        per_position = max(0.0, (self._xy / self._w - mean_x * mean_y) / var_x)
        return max(0.0, mean_y - per_position * mean_x), per_position

    def bar(self, decodes: int) -> float | None:
        """The chance a draft token must have of being kept to pay at `decodes` decoding
        samples: per_position / ((fixed + per_position x decodes) / decodes); None: not known
        yet."""
        fitted = self.line()
        if fitted is None:
            return None
        fixed, per_position = fitted
        step = fixed + per_position * decodes
        return per_position * decodes / step if step > 0 else 0.0
