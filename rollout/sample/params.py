"""SamplingParams: what one prompt asks for, validated before anything is queued."""

from __future__ import annotations

import numbers
import struct
from dataclasses import dataclass, field

from ..fields import (INT32_MAX, INT32_MIN, SEED_LIMIT, as_bool, as_float, as_int, scalar,
                      show)

# Smallest temperature above 0 (greedy): the sampler divides float32 logits by it, and a much
# tinier one overflows them to inf (1e-38 does), which would read as a broken model.
MIN_TEMPERATURE = 1e-4
# The sampler holds temperatures in float32: a larger one would become inf.
MAX_TEMPERATURE = 3.4028234663852886e38
# Every sample becomes a Sequence at intake; more than this is a mistake, not a workload.
MAX_N = 1 << 16
# Alternatives per token (top_logprobs, Engine.score): each costs a top-k over the vocabulary and
# two numbers per token on the host; vLLM's default bound.
MAX_TOP_LOGPROBS = 20


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
    # True: each token's logprob; an int k (vLLM's semantics): that and k alternatives (read as
    # top_logprobs = k in the engine's copy only, so setting logprobs=False later turns both off)
    logprobs: bool | int = False
    # Each token's k most likely alternatives under the same distribution (Sample.top_logprobs)
    top_logprobs: int = 0
    # Each Sample's `support`: the token ids the truncated distribution of each token kept.
    return_support: bool = False
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
        if _float32(self.top_p) == 1:  # the sampler's value: it cuts nothing (the token reads
            self.top_p = 1.0           # as drawn from the whole vocabulary)
        self.min_p = as_float("min_p", self.min_p)
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None:
            self.seed = as_int("seed", self.seed, 0, SEED_LIMIT - 1)
        self.ignore_eos = as_bool("ignore_eos", self.ignore_eos)
        # (0-d arrays and tensors as the scalars they hold, like every numeric field)
        self.top_logprobs = as_int("top_logprobs", self.top_logprobs, 0, MAX_TOP_LOGPROBS)
        logprobs = scalar(self.logprobs)
        if not isinstance(logprobs, bool) and isinstance(logprobs, numbers.Integral):
            k = as_int("logprobs", logprobs, 0, MAX_TOP_LOGPROBS)
            if self.top_logprobs not in (0, k):
                raise ValueError(f"logprobs={k} asks for {k} alternatives but top_logprobs="
                                 f"{show(self.top_logprobs)}: give one of them")
            self.logprobs = k
        else:
            self.logprobs = as_bool("logprobs", logprobs)
        self.return_support = as_bool("return_support", self.return_support)
        self.return_routed_experts = as_bool("return_routed_experts",
                                             self.return_routed_experts)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def stop_ids(self, eos_ids: frozenset[int]) -> frozenset[int]:
        """The token ids a sample stops on: the model's end ids (unless ignore_eos) and
        stop_token_ids."""
        return frozenset(self.stop_token_ids) | (frozenset() if self.ignore_eos else eos_ids)

    def resolve(self, vocab_size: int) -> None:
        """The engine's own copy, at intake: the checks that need the vocabulary, and the
        fields as the engine reads them: logprobs=k as logprobs=True with top_logprobs=k, any
        alternatives with each token's logprob; a top_k that keeps every token is off, so the
        token reads as drawn from the whole vocabulary (its sampling logprob its logprob, its
        support 'all')."""
        given = "top_logprobs"
        if not isinstance(self.logprobs, bool):
            given, self.logprobs, self.top_logprobs = "logprobs", True, self.logprobs
        self.logprobs = self.logprobs or self.top_logprobs > 0
        if self.top_k >= vocab_size:
            self.top_k = 0
        if self.top_logprobs > vocab_size:
            raise ValueError(f"{given} must be at most the vocabulary ({vocab_size}), "
                             f"got {self.top_logprobs}")
        for t in self.stop_token_ids:
            if t >= vocab_size:
                raise ValueError(f"stop_token_ids: {t} is outside the vocabulary [0, {vocab_size})")


def _float32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


def _as_list(name: str, value) -> list:
    if value is None:
        return []
    # A 0-d array or tensor cannot be iterated; bytes would be read as their byte values
    # (b"1" as id 49) and a dict as its keys.
    if getattr(value, "ndim", None) == 0 or isinstance(value, (bytes, bytearray, dict)):
        raise ValueError(f"{name} must be a list, got {show(value)}")
    try:
        return list(value)
    except TypeError:
        raise ValueError(f"{name} must be a list, got {show(value)}") from None
