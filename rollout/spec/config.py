"""SpeculativeConfig: which drafter, how many tokens, when it turns itself off."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..fields import as_bool, as_choice, as_float, as_int

METHODS = ("ngram", "draft", "suffix")
ACCEPTANCE = ("coupled", "rejection")
MAX_SPECULATIVE_TOKENS = 16
# The longest history match: a lookup extends its match a token at a time (one comparison over
# its candidates, ~2.5 us), so a match of n tokens costs ~2.5 us x n per sample per step, ~2.6 ms
# at this bound (spec/history.py matches, measured on a 2-core Intel Xeon): beyond it the host
# time of each step's lookups would outgrow what their drafts save.
MAX_HISTORY_MATCH = 1024


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
    # acceptance for draft models, whose outputs then depend on the drafts (n-gram and suffix
    # drafts are verified coupled under either: see spec/verify.py).
    acceptance: str = "coupled"
    # Per sample, draft only as far as its running acceptance makes pay against the machine's
    # measured step cost at this batch size (Speculator._paying, spec/cost.py; the batch's
    # share of max_batch_size where the drafts shape the outputs).
    adaptive: bool = False
    # "suffix" (spec/suffix.py, spec/history.py): the finished samples of earlier calls, kept
    # in host memory up to this many tokens (oldest evicted first), matched on suffixes of up
    # to history_max_match tokens (ngram_min at least); a drafted token must continue at least
    # history_min_share of the matched positions.
    history_tokens: int = 1 << 20
    history_max_match: int = 32
    history_min_share: float = 0.3

    @property
    def drafts_shape_outputs(self) -> bool:
        """Whether the emitted tokens depend on the drafts: a draft model's (stochastic)
        proposals under "rejection" (spec/verify.py verifies every other proposal coupled).
        Then nothing that decides the drafts may follow the clock (Speculator._bar)."""
        return self.acceptance == "rejection" and self.method == "draft"

    def __post_init__(self) -> None:
        self.method = as_choice("speculative.method", self.method, METHODS)
        self.acceptance = as_choice("speculative.acceptance", self.acceptance, ACCEPTANCE)
        self.num_speculative_tokens = as_int("speculative.num_speculative_tokens",
                                             self.num_speculative_tokens, 1,
                                             MAX_SPECULATIVE_TOKENS)
        self.ngram_min = as_int("speculative.ngram_min", self.ngram_min, 1)
        self.ngram_max = as_int("speculative.ngram_max", self.ngram_max, 1)
        if self.ngram_min > self.ngram_max:
            raise ValueError(f"speculative.ngram_min must be <= ngram_max, got {self.ngram_min} "
                             f"> {self.ngram_max}")
        self.max_batch_size = as_int("speculative.max_batch_size", self.max_batch_size, 1)
        self.adaptive = as_bool("speculative.adaptive", self.adaptive)
        self.history_tokens = as_int("speculative.history_tokens", self.history_tokens, 1)
        self.history_max_match = as_int("speculative.history_max_match",
                                        self.history_max_match, self.ngram_min,
                                        MAX_HISTORY_MATCH)
        self.history_min_share = as_float("speculative.history_min_share",
                                          self.history_min_share)
        if not 0 < self.history_min_share <= 1:
            raise ValueError(f"speculative.history_min_share must be in (0, 1], got "
                             f"{self.history_min_share}")
        if self.method == "draft" and self.draft_model is None:
            raise ValueError("speculative.draft_model is required when method='draft'")
        if self.method != "draft" and self.draft_model is not None:  # (not silently unused)
            raise ValueError(f"speculative.draft_model is read by method='draft' only, got "
                             f"method={self.method!r}")
