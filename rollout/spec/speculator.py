"""Speculation within an engine step: propose before the forward, verify after it."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from ..ops.op import Op, always, on_cuda
from ..requests.batch import Batch, ScheduledSeq
from ..requests.sequence import Sequence
from .accept import accept_drafts_ref
from .config import SpeculativeConfig
from .cost import StepCost
from .ngram import NgramDrafter
from .verify import Verdict, verify


def _accept_triton(**rows):
    from rollout_kernels.triton.spec_accept import accept_drafts

    return accept_drafts(**rows)


# How fast the running acceptance follows each verification: the engine's slowly (many samples
# feed it), a sample's fast (its own text changes character within a few tokens).
RATE_ENGINE, RATE_SAMPLE = 0.05, 0.3

# _journaled's value that drops the key.
_DROP = object()

# The acceptance scan along each request's drafts (verify.py).
ACCEPT = Op("accept_drafts", torch=(accept_drafts_ref, always), triton=(_accept_triton, on_cuda))


@dataclass(frozen=True, slots=True)
class Verified:
    """What one sample's verification gave it, as committed: a stop or the length may cut its
    verdict, and drafts accepted past the cut were never the sample's."""

    source: str  # where the draft came from (Speculator.sources)
    proposed: int  # draft tokens verified
    accepted: int  # of them, accepted and kept
    emitted: int  # tokens kept: those, and the correction or bonus token unless cut off


def make_speculator(config: SpeculativeConfig | None, stack, engine_config, draft_model,
                    siblings: Callable[[Sequence], list[Sequence]]) -> Speculator | None:
    """The engine's speculator for `config` (None: off; the engine's own checked copy,
    EngineConfig's), drafting for the model of `stack`; `draft_model`: method "draft"'s model,
    built by draft_model.build_draft_model."""
    if config is None:
        return None
    drafter = None
    if config.method == "draft":
        from .draft_model import DraftModelDrafter

        drafter = DraftModelDrafter(draft_model, stack, engine_config, config.acceptance)
    elif config.method == "suffix":
        from .suffix import SuffixDrafter

        drafter = SuffixDrafter(config, stack.kv.journal)
    return Speculator(config, stack, engine_config.max_model_len, siblings, drafter,
                      engine_config.max_num_batched_tokens)


class Speculator:
    def __init__(self, config: SpeculativeConfig, stack, max_model_len: int,
                 siblings: Callable[[Sequence], list[Sequence]], drafter=None,
                 max_batched_tokens: int | None = None) -> None:
        """`stack`: the target's model stack (its KV manager holds the drafts' slots, its
        backend chooses the acceptance scan, its sampler draws the target's tokens);
        `max_batched_tokens`: the step's token budget (EngineConfig.max_num_batched_tokens),
        which the drafts' verify positions count against as the scheduled tokens do."""
        self.config, self.kv = config, stack.kv
        self.max_batched_tokens = max_batched_tokens
        self.sampler = stack.sampler
        self.accept = stack.backend.bind(ACCEPT)
        self.max_model_len, self.siblings = max_model_len, siblings
        self.drafter = drafter or NgramDrafter(config.ngram_min, config.ngram_max)
        # seq_id -> (consecutive fully rejected rounds, output length when they were counted,
        # output length at which it proposes again): a sample whose drafts keep failing stops
        # paying for verification, with exponential back-off so it is probed again now and
        # then. The wait is counted in the sample's own tokens (one per step while it does not
        # draft), not by counting steps down: a proposal then changes nothing, so a step that
        # fails after it leaves no trace. A sample shorter than when it was counted (restarted
        # from its prompt, a stale group) waits no more.
        self._misses: dict[int, tuple[int, int, int]] = {}
        # seq_id -> where this step's draft came from ("self", "siblings", "history"; the
        # draft model's: "draft"), for the per-source stats.
        self.sources: dict[int, str] = {}
        # Running acceptance per draft token (exponential averages) per draft source: the
        # engine's, and each sample's (seq_id -> source -> rate), which set the adaptive draft
        # length (_paying). Like the back-off, changed only through _journaled.
        self.rates: dict[str, float] = {}
        self._rates: dict[int, dict[str, float]] = {}
        # This step's decodes were more than max_batch_size (no drafting): for the stats.
        self.skipped = False
        # The machine's step cost against the positions computed (adaptive draft lengths).
        self.cost = StepCost()

    def _budget(self, seq: Sequence) -> int:
        """Drafts never run past max_tokens or max_model_len (one token is the target's)."""
        return min(self.config.num_speculative_tokens,
                   seq.params.max_tokens - seq.num_output - 1,
                   self.max_model_len - seq.num_tokens - 1)

    def _bar(self, decodes: int) -> float:
        """The chance a draft token must have of being kept to pay at `decodes` decoding
        samples (_paying): from the measured step cost, else the batch's share of
        max_batch_size: before the cost is known, and always where the drafts shape the
        outputs (SpeculativeConfig.drafts_shape_outputs), which must not follow the machine's
        clock (its load)."""
        bar = None if self.config.drafts_shape_outputs else self.cost.bar(decodes)
        return decodes / self.config.max_batch_size if bar is None else bar

    def _paying(self, seq: Sequence, source: str, bar: float) -> int:
        """SpeculativeConfig.adaptive: the draft length whose last token still has a fair
        chance. Draft token i is kept with about a**i (a: the running acceptance per draft
        token of this sample's drafts from `source`, or of the engine's from it before the
        sample has one), and a verify position is worth it while that chance beats `bar`
        (_bar, once a step: the machine's measured step cost, spec/cost.py): a sample alone in
        a rollout's tail drafts long where a step costs about the same whatever its size, a
        full batch on a CPU only what it nearly always keeps. At least one token, so the
        estimate keeps learning (the back-off handles total misses)."""
        a = self._rates.get(seq.seq_id, {}).get(source, self.rates.get(source, 0.5))
        if a >= 1 or bar <= 0:
            return self.config.num_speculative_tokens
        if a <= 0 or bar >= 1:
            return 1
        return max(1, int(math.log(bar) / math.log(a)))

    def observe_step(self, positions: int, seconds: float) -> None:
        """A completed step's positions and forward-and-sampling seconds, for the cost."""
        self.cost.observe(positions, seconds)

    def propose(self, batch: Batch) -> int:
        """Attach drafts to the batch's decode items; returns how many items got some."""
        self.drafter.flush()
        self.sources = {}
        decodes = [it for it in batch.items if it.sample and it.num_new == 1]
        self.skipped = len(decodes) > self.config.max_batch_size
        if not decodes or self.skipped:
            return 0
        # what the scheduler left of the step's token budget: drafts beyond it are cut, and
        # none is asked for longer than all of it (a draft model's forwards)
        room = (self.max_batched_tokens - batch.num_tokens if self.max_batched_tokens
                else math.inf)
        bar = self._bar(len(decodes)) if self.config.adaptive else None
        wanted = self._asked(decodes, room, bar)
        if not wanted:
            return 0
        proposals = self.drafter.propose_batch([(it.seq, k) for it, k in wanted], self.siblings)
        origins = self.drafter.last_sources or [self.config.method] * len(wanted)
        extended = 0
        with self.kv.journal.unit():
            for (it, _), (draft, probs), origin in zip(wanted, proposals, origins):
                keep = len(draft)
                if draft and self.config.adaptive:
                    keep = self._paying(it.seq, origin, bar)
                keep = max(0, min(keep, room))
                if keep < len(draft):
                    draft, probs = draft[:keep], None if probs is None else probs[:keep]
                if draft and self._add_draft(it, draft, probs):
                    room -= len(draft)
                    extended += 1
                    self.sources[it.seq.seq_id] = origin
        return extended

    def _asked(self, decodes: list[ScheduledSeq], room: float,
               bar: float | None) -> list[tuple[ScheduledSeq, int]]:
        """(item, draft tokens to ask for) of the decodes ready to draft, within the budget
        and the step's room. A costly drafter (a draft model: a forward for every token it
        proposes) is asked only for what will be verified: what pays under adaptive drafting
        (`bar`), within the room those before it leave; asked for more, it computed tokens
        cut after for nothing. The others' proposals are cut once proposed: a suffix
        proposal's source, which the bar depends on, is known only then, and a short one
        leaves its room to the next."""
        wanted = []
        for it in decodes:
            if not self._ready(it.seq):
                continue
            k = min(self._budget(it.seq), room)
            if self.drafter.costly:
                if bar is not None:
                    k = min(k, self._paying(it.seq, self.config.method, bar))
                room -= max(k, 0)
            if k > 0:
                wanted.append((it, k))
        return wanted

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
        return state is None or not state[1] <= seq.num_output < state[2]

    def after_commit(self, batch: Batch, verdicts, kept: list[int]) -> list[Verified]:
        """Learn the acceptance and update the back-off from what each verification committed
        (`verdicts`: one per sampled item, `kept`: how many of its tokens the commit kept),
        and let the drafter drop K/V of rejected proposals. Returns the verifications, for the
        stats."""
        sampled = [it for it in batch.items if it.sample]
        verified, seqs = [], []
        for it, verdict, got in zip(sampled, verdicts, kept):
            if not it.draft:
                continue
            seqs.append(it.seq)
            done = Verified(self.sources[it.seq.seq_id], len(it.draft),
                            min(verdict.accepted, got), got)
            verified.append(done)
            self._learn(it.seq.seq_id, done.source, done.accepted / done.proposed)
            misses = 0 if done.accepted else self._misses.get(it.seq.seq_id, (0,))[0] + 1
            wait, at = min(2 ** misses, 32) if misses else 0, it.seq.num_output
            self._journaled(self._misses, it.seq.seq_id, (misses, at, at + wait))
        self.drafter.rollback(seqs)
        return verified

    def _learn(self, seq_id: int, source: str, share: float) -> None:
        """One verification's share of accepted draft tokens into the running rates."""
        engine, own = self.rates.get(source, 0.5), self._rates.get(seq_id, {})
        self._journaled(self.rates, source, engine + RATE_ENGINE * (share - engine))
        mine = own.get(source, engine)
        self._journaled(self._rates, seq_id, {**own, source: mine + RATE_SAMPLE * (share - mine)})

    def _journaled(self, table: dict, key, value=_DROP) -> None:
        """table[key] = value (_DROP: the key dropped), undone with the journal's unit: the
        back-off and the rates decide the drafts, which must be as if a failed step never ran.
        Values are replaced, never changed in place, so the undo can hold the old one."""
        if key in table:
            old = table[key]
            self.kv.journal.record(lambda: table.__setitem__(key, old))
        else:
            self.kv.journal.record(lambda: table.pop(key, None))
        if value is _DROP:
            table.pop(key, None)
        else:
            table[key] = value

    @property
    def backoff_sequences(self) -> frozenset[int]:
        """Ids of the sequences that hold back-off state: only running ones should (ids only
        grow in a trainer, so an entry that outlives its request is a leak)."""
        return frozenset(self._misses) | frozenset(self._rates)

    def forget(self, seqs: list[Sequence]) -> None:
        """The request ended (finished or aborted): drop its back-off state; the drafter may
        remember its samples (suffix.py)."""
        for seq in seqs:
            self._journaled(self._misses, seq.seq_id)
            self._journaled(self._rates, seq.seq_id)
        self.drafter.remember(seqs)

    def verify(self, logits, rows, items, want_support=None) -> list[Verdict]:
        """The verdicts of one step's sampled items (rows: one per verified position)."""
        return verify(logits, rows, [it.draft for it in items], [it.draft_probs for it in items],
                      self.config.acceptance, self.sampler.pick, self.accept, want_support)

    def discard_pending(self) -> None:
        self.drafter.discard_pending()

    def check_invariants(self) -> None:
        self.drafter.check_invariants()
