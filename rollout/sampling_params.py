"""SamplingParams: what one prompt asks for, validated before anything is queued."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


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
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.stop = list(self.stop or [])
        _check_int("n", self.n, low=1)
        _check_int("max_tokens", self.max_tokens, low=1)
        _check_int("top_k", self.top_k)
        if not _finite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not _finite(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not _finite(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None:
            _check_int("seed", self.seed)
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must be a list of non-empty strings, got {self.stop!r}")
        for t in self.stop_token_ids:
            _check_int("stop_token_ids", t, low=0)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def check_vocab(self, vocab_size: int) -> None:
        for t in self.stop_token_ids:
            if t >= vocab_size:
                raise ValueError(f"stop_token_ids: {t} is outside the vocabulary [0, {vocab_size})")


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _check_int(name: str, value, low: int | None = None) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if low is not None and value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
