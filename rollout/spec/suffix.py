"""Suffix drafting (SpeculativeConfig(method="suffix")): the n-gram drafter's own-tokens and
siblings search, and the history of earlier calls' finished samples (history.py). Whichever
source matches the longest suffix of the sequence drafts (ties: its own tokens, then its
siblings, then history); from history the draft is the majority continuation of every position
that matched, as long as it stays the continuation of at least `min_share` of them, so its
length follows how much earlier samples agreed.

Finished samples enter the history after the journal unit that finished them has committed
(`remember` journals the pending entry; the next step's proposal flushes it, in a unit of its
own), so a failed step leaves the history as it was, and a failed flush too (without the
samples it was adding). Verification makes any draft safe: these deterministic proposals are
verified coupled under either acceptance, so they never change an output (verify.py).
"""

from __future__ import annotations

from ..journal import Journal
from ..requests.sequence import Sequence
from .history import DraftHistory
from .ngram import NgramDrafter


class SuffixDrafter(NgramDrafter):
    def __init__(self, config, journal: Journal) -> None:
        super().__init__(config.ngram_min, config.ngram_max)
        self.history = DraftHistory(config.history_tokens, config.ngram_min,
                                    config.history_max_match, journal)
        self.min_share, self.journal = config.history_min_share, journal
        self._pending: list[tuple[list[int], list[int]]] = []
        self.last_sources: list[str | None] = []

    def remember(self, seqs: list[Sequence]) -> None:
        """Samples of a request that left the engine; the finished ones join the history."""
        for seq in seqs:
            if seq.finish_reason in ("stop", "length") and seq.num_output:
                self._pending.append((seq.prompt_ids, seq.output_ids))
                self.journal.record(self._pending.pop)

    def clear(self) -> None:
        self.history.clear()
        self._pending.clear()

    def flush(self) -> None:
        """Pending samples into the history, all of them or none. A flush that fails drops
        them: the history only feeds drafts, and samples that cannot enter (memory, say)
        must not fail every later step."""
        pending, self._pending = self._pending, []
        if pending:
            with self.journal.unit():
                for prompt, completion in pending:
                    self.history.add(prompt, completion)

    def check_invariants(self) -> None:
        self.history.check()

    def propose_batch(self, wanted: list[tuple[Sequence, int]], siblings):
        proposals, self.last_sources, hays = [], [], {}
        for seq, k in wanted:
            draft, source = self.propose_from(seq, siblings(seq), k, hays)
            proposals.append((draft, None))
            self.last_sources.append(source)
        return proposals

    def propose_from(self, seq: Sequence, siblings: list[Sequence], k: int,
                     hays: dict[int, tuple[list[int], bytes]]) -> tuple[list[int], str | None]:
        own, own_len, source = self.search(seq, siblings, k, hays)
        length, positions = self.history.matches(seq.token_ids, seq.prompt_ids)
        if length > own_len:
            drafted = self.history.continuation(positions, k, self.min_share)
            if drafted:
                return drafted, "history"
        return own, source
