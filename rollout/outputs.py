"""What generate returns: one RolloutOutput per prompt, with its n samples."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Sample:
    index: int
    token_ids: list[int]
    logprobs: list[float] | None  # log_softmax(logits / T) of each token; None unless asked
    finish_reason: str  # "stop" | "length" | "abort"
    text: str | None = None

    @property
    def cumulative_logprob(self) -> float | None:
        return None if self.logprobs is None else sum(self.logprobs)


@dataclass
class RolloutOutput:
    request_id: str
    prompt_token_ids: list[int]
    samples: list[Sample] = field(default_factory=list)
    prompt: str | None = None
