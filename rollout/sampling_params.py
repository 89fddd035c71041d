"""SamplingParams: what one prompt asks for, validated before anything is queued."""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field

# Smallest temperature above 0 (greedy): the sampler divides float32 logits by it, and a much
# tinier one overflows them to inf (1e-38 does), which would read as a broken model.
MIN_TEMPERATURE = 1e-4
# Seeds are hashed as two 32-bit halves (sampler.sample_seed): larger ones would alias.
SEED_LIMIT = 1 << 64


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # <= 0: off
    top_p: float = 1.0
    min_p: float = 0.0
    max_tokens: int = 16
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: bool = False

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check every field (ValueError naming it and its limit) and normalise: `stop` may be
        one string, integer fields take any integer type (numpy's, 0-d tensors). The engine
        runs this again on its own copy at intake, since fields can be set after construction."""
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = _as_list("stop", self.stop)
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must be a list of non-empty strings, got {self.stop!r}")
        self.stop_token_ids = [as_int("stop_token_ids", t, low=0)
                               for t in _as_list("stop_token_ids", self.stop_token_ids)]
        self.n = as_int("n", self.n, low=1)
        self.max_tokens = as_int("max_tokens", self.max_tokens, low=1)
        self.top_k = as_int("top_k", self.top_k)
        if not _finite(self.temperature) or not (
                self.temperature == 0 or self.temperature >= MIN_TEMPERATURE):
            raise ValueError(f"temperature must be 0 (greedy) or a finite number >= "
                             f"{MIN_TEMPERATURE:g}, got {self.temperature}")
        if not _finite(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not _finite(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None:
            self.seed = as_int("seed", self.seed)
            if not 0 <= self.seed < SEED_LIMIT:
                raise ValueError(f"seed must be in [0, 2**64), got {self.seed}")
        for name in ("ignore_eos", "logprobs"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def check_vocab(self, vocab_size: int) -> None:
        for t in self.stop_token_ids:
            if t >= vocab_size:
                raise ValueError(f"stop_token_ids: {t} is outside the vocabulary [0, {vocab_size})")


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def as_int(name: str, value, low: int | None = None) -> int:
    """`value` as a plain int: any integer type is accepted, bool and float are not."""
    if isinstance(value, bool):
        raise _not_int(name, value)
    try:
        value = operator.index(value)
    except TypeError:
        raise _not_int(name, value) from None
    if low is not None and value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    return value


def _not_int(name: str, value) -> ValueError:
    return ValueError(f"{name} must be an int, got {value!r}")


def _as_list(name: str, value) -> list:
    if value is None:
        return []
    try:
        return list(value)
    except TypeError:
        raise ValueError(f"{name} must be a list, got {value!r}") from None
