"""SpeculativeConfig: which drafter, how many tokens, when it turns itself off."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

METHODS = ("ngram", "draft")


@dataclass
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 4
    draft_model: Any = None  # "draft": a transformers model (same tokenizer) or a local path
    ngram_min: int = 1
    ngram_max: int = 4
    # Verification costs k+1 positions per sample: above this many decoding samples the batch
    # is compute-bound and drafting stops paying, so it is skipped for that step.
    max_batch_size: int = 32
    # "coupled": speculation never changes an output; "rejection": textbook min(1, p/q)
    # acceptance for draft models (see spec/verify.py).
    acceptance: str = "coupled"

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative.method must be one of {METHODS}, got {self.method!r}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or not 1 <= k <= 16:
            raise ValueError(f"speculative.num_speculative_tokens must be in [1, 16], "
                             f"got {self.num_speculative_tokens!r}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"speculative.ngram_min/ngram_max must satisfy 1 <= min <= max, "
                             f"got {self.ngram_min}, {self.ngram_max}")
        if self.max_batch_size < 1:
            raise ValueError(f"speculative.max_batch_size must be >= 1, got {self.max_batch_size}")
        if self.acceptance not in ("coupled", "rejection"):
            raise ValueError(f"speculative.acceptance must be 'coupled' or 'rejection', "
                             f"got {self.acceptance!r}")
        if self.method == "draft" and self.draft_model is None:
            raise ValueError("speculative.draft_model is required when method='draft'")
