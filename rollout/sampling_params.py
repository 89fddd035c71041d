"""SamplingParams: what one prompt asks for, validated before anything is queued."""

from __future__ import annotations

import math
import numbers
import reprlib
from dataclasses import dataclass, field

# Smallest temperature above 0 (greedy): the sampler divides float32 logits by it, and a much
# tinier one overflows them to inf (1e-38 does), which would read as a broken model.
MIN_TEMPERATURE = 1e-4
# The sampler holds temperatures in float32: a larger one would become inf.
MAX_TEMPERATURE = 3.4028234663852886e38
# Seeds are hashed as two 32-bit halves (counter_noise.sample_seed): larger ones would alias.
SEED_LIMIT = 1 << 64
# top_k, token ids and positions go to the sampler and kernels as int32.
INT32_MIN, INT32_MAX = -(1 << 31), (1 << 31) - 1
# Every sample becomes a Sequence at intake; more than this is a mistake, not a workload.
MAX_N = 1 << 16


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
    # MoE models: each sample's Sample.routed_experts (outputs.py), for routing replay.
    return_routed_experts: bool = False

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check every field (ValueError naming it and its limit) and normalise to plain Python
        values: `stop` may be one string, numeric fields take numpy scalars and 0-d arrays or
        tensors. The engine runs this again on its own copy at intake, since fields can be set
        after construction."""
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = _as_list("stop", self.stop)
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must be a list of non-empty strings, "
                                 f"got {show(self.stop)}")
        self.stop_token_ids = [as_int("stop_token_ids", t, 0, INT32_MAX)
                               for t in _as_list("stop_token_ids", self.stop_token_ids)]
        self.n = as_int("n", self.n, 1, MAX_N)
        self.max_tokens = as_int("max_tokens", self.max_tokens, 1, INT32_MAX)
        self.top_k = as_int("top_k", self.top_k, INT32_MIN, INT32_MAX)
        self.temperature = as_float("temperature", self.temperature)
        if not (self.temperature == 0 or MIN_TEMPERATURE <= self.temperature <= MAX_TEMPERATURE):
            raise ValueError(f"temperature must be 0 (greedy) or in [{MIN_TEMPERATURE:g}, "
                             f"{MAX_TEMPERATURE:g}], got {self.temperature}")
        self.top_p = as_float("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        self.min_p = as_float("min_p", self.min_p)
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None:
            self.seed = as_int("seed", self.seed, 0, SEED_LIMIT - 1)
        self.ignore_eos = as_bool("ignore_eos", self.ignore_eos)
        self.logprobs = as_bool("logprobs", self.logprobs)
        self.return_routed_experts = as_bool("return_routed_experts",
                                             self.return_routed_experts)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def check_vocab(self, vocab_size: int) -> None:
        for t in self.stop_token_ids:
            if t >= vocab_size:
                raise ValueError(f"stop_token_ids: {t} is outside the vocabulary [0, {vocab_size})")


def as_int(name: str, value, low: int | None = None, high: int | None = None) -> int:
    """`value` as a plain int in [low, high]: any integer type is accepted (numpy's, 0-d arrays
    and tensors), bool and float are not."""
    value = _item(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an int, got {show(value)}")
    value = int(value)
    if (low is not None and value < low) or (high is not None and value > high):
        raise ValueError(f"{name} must be {_bounds(low, high)}, got {show(value)}")
    return value


def as_float(name: str, value) -> float:
    """`value` as a finite plain float: ints, floats, numpy scalars and 0-d arrays/tensors."""
    value = _item(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a real number, got {show(value)}")
    try:
        result = float(value)
    except OverflowError:  # an int beyond float's range
        result = math.inf
    if not math.isfinite(result):
        raise ValueError(f"{name} must be a finite float, got {show(value)}")
    return result


def as_bool(name: str, value) -> bool:
    value = _item(value)
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {show(value)}")
    return value


def as_choice(name: str, value, choices: tuple[str, ...]) -> str:
    # The type check first: `in` would compare an array elementwise and raise its own error.
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {show(value)}")
    return value


def show(value) -> str:
    """A short repr for an error message: str() refuses ints over 4300 digits."""
    if isinstance(value, int) and value.bit_length() > 128:
        return f"an int of {value.bit_length()} bits"
    return reprlib.repr(value)


def _item(value):
    """numpy scalars and 0-d arrays/tensors as the Python scalar they hold. Anything with more
    dimensions is left for the caller to refuse (operator.index would take a 1-element tensor)."""
    if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):
        return value.item()
    return value


def _bounds(low: int | None, high: int | None) -> str:
    if high is None:
        return f">= {low}"
    if low is None:
        return f"<= {_spell(high)}"
    return f"in [{_spell(low)}, {_spell(high)}]"


def _spell(limit: int) -> str:
    """A limit at a power of two as 2**k (2**31 - 1, -2**31), which says which width it is."""
    sign, size = ("-" if limit < 0 else ""), abs(limit)
    if size >= 1 << 16 and size & (size - 1) == 0:
        return f"{sign}2**{size.bit_length() - 1}"
    if size >= 1 << 16 and size & (size + 1) == 0:
        return f"{sign}2**{size.bit_length()} - 1"
    return str(limit)


def _as_list(name: str, value) -> list:
    if value is None:
        return []
    if getattr(value, "ndim", None) == 0:  # iterating a 0-d array or tensor raises TypeError
        raise ValueError(f"{name} must be a list, got {show(value)}")
    try:
        return list(value)
    except TypeError:
        raise ValueError(f"{name} must be a list, got {show(value)}") from None
