"""Speculation within an engine step: propose before the forward, verify after it."""

from __future__ import annotations

from collections.abc import Callable

from ..batch import Batch, ScheduledSeq
from ..kv_manager import KVManager
from ..request import Sequence
from .config import SpeculativeConfig
from .ngram import NgramDrafter


class Speculator:
    def __init__(self, config: SpeculativeConfig, kv: KVManager, max_model_len: int,
                 siblings: Callable[[Sequence], list[Sequence]], drafter=None) -> None:
        self.config, self.kv = config, kv
        self.max_model_len, self.siblings = max_model_len, siblings
        self.drafter = drafter or NgramDrafter(config.ngram_min, config.ngram_max)
        # seq_id -> (consecutive fully rejected rounds, steps left before proposing again):
        # a sample whose drafts keep failing stops paying for verification, with exponential
        # back-off so it is probed again now and then.
        self._misses: dict[int, list[int]] = {}

    def _budget(self, seq: Sequence) -> int:
        """Drafts never run past max_tokens or max_model_len (one token is the target's)."""
        return min(self.config.num_speculative_tokens,
                   seq.params.max_tokens - seq.num_output - 1,
                   self.max_model_len - seq.num_tokens - 1)

    def propose(self, batch: Batch) -> int:
        """Attach drafts to the batch's decode items; returns how many items got some."""
        decodes = [it for it in batch.items if it.sample and it.num_new == 1]
        if not decodes or len(decodes) > self.config.max_batch_size:
            return 0
        wanted = [(it, self._budget(it.seq)) for it in decodes if self._ready(it.seq)]
        wanted = [(it, k) for it, k in wanted if k > 0]
        proposals = self.drafter.propose_batch([(it.seq, k) for it, k in wanted], self.siblings)
        extended = 0
        with self.kv.journal.unit():
            for (it, _), (draft, probs) in zip(wanted, proposals):
                if draft and self._add_draft(it, draft, probs):
                    extended += 1
        return extended

    def _add_draft(self, item: ScheduledSeq, draft: list[int], probs) -> bool:
        """Slots for the proposals to verify; False (item unchanged) when the pool has no
        room for them even after eviction: drafts never preempt anyone."""
        slots = self.kv.alloc(len(draft))
        if slots is None:
            return False
        self.kv.place(item.seq, item.start + item.num_new, slots)
        item.add_draft(draft, probs, slots)
        return True

    def _ready(self, seq: Sequence) -> bool:
        state = self._misses.get(seq.seq_id)
        if state is None or state[1] == 0:
            return True
        state[1] -= 1
        return False

    def after_commit(self, batch: Batch, verdicts) -> None:
        """Update the back-off (`verdicts`: one per sampled item), and let the drafter drop
        K/V of rejected proposals."""
        sampled = [it for it in batch.items if it.sample]
        verified = []
        for it, verdict in zip(sampled, verdicts):
            if not it.draft:
                continue
            verified.append(it.seq)
            state = self._misses.setdefault(it.seq.seq_id, [0, 0])
            if verdict.accepted:
                state[0] = 0
            else:
                state[0] += 1
                state[1] = min(2 ** state[0], 32)
        self.drafter.rollback(verified)

    @property
    def backoff_sequences(self) -> frozenset[int]:
        """Ids of the sequences that hold back-off state: only running ones should (ids only
        grow in a trainer, so an entry that outlives its request is a leak)."""
        return frozenset(self._misses)

    def forget(self, seqs: list[Sequence]) -> None:
        """The request ended (finished or aborted): drop its back-off state."""
        for seq in seqs:
            self._misses.pop(seq.seq_id, None)

    def discard_pending(self) -> None:
        self.drafter.discard_pending()

    def check_invariants(self) -> None:
        self.drafter.check_invariants()
