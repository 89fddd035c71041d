"""Commit: what a step's forward produced becomes the sequences' state.

It runs inside one journal unit after the forward (see StepRunner.run, rollout/engine/step.py),
so it happens whole or not at all. First every sampled sequence gets its verdict without
changing anything: non-finite logprobs, or a stop check (user tokenizer code) that raises, fail
the sequence's request alone.
Then the step's slots are stamped with the weights version that computed them (MoE models:
kv/pool.py SLOT_VERSION), tokens are appended, K/V advanced, rejected drafts' slots freed,
finished prompts cached for their siblings, and finished sequences retired (with their routed
experts and those versions, when asked, read from the KV pool while the sequence still holds
its slots).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from ..journal import Journal
from ..kv.manager import KVManager
from ..models.base import ROUTED_EXPERTS
from ..requests.batch import Batch, ScheduledSeq
from ..requests.sequence import Sequence
from ..sample.sampler import Emitted
from ..score.state import ScoreRows
from .scheduler import Scheduler
from .stop import StopChecker


@dataclass
class Failure:
    error: str
    keep_kv: bool  # False: the K/V may hold the non-finite values; caching it would poison


@dataclass(slots=True)
class _Verdict:
    emitted: Emitted  # cut at the stop
    reason: str | None
    stop_text_at: int | None


class Committer:
    def __init__(self, kv: KVManager, scheduler: Scheduler, stop: StopChecker,
                 journal: Journal, weights_version: Callable[[], int]) -> None:
        """`weights_version`: the engine's, stamped on every token committed."""
        self.kv, self.scheduler, self.stop, self.journal = kv, scheduler, stop, journal
        self.weights_version = weights_version
        self.prompt_tokens_computed = 0  # prompt positions actually run through the model
        self.score_tokens_computed = 0  # positions of scored sequences run (Engine.score)

    def commit(self, batch: Batch, emitted: list[Emitted], scored: list[ScoreRows | None]
               ) -> tuple[list[Sequence], dict[str, Failure], list[int]]:
        """Advance every scheduled sequence by what it kept (one token, or accepted drafts plus
        one when verifying; a scored sequence its rows). Returns the sequences that finished,
        the requests that failed (their sequences are left as they were; the caller aborts
        them), and how many of its emitted tokens each sampled item kept (fewer past a stop
        or the length, none when its request failed: what speculation's stats count)."""
        verdicts, failed = self._verdicts(batch, emitted, scored)
        version = self.weights_version()
        if self.kv.pool.keeps_versions:
            # Every slot written this step, rejected drafts' and failed requests' too: those
            # are freed, and the next forward to take a slot stamps it again.
            self.kv.pool.stamp_version(batch.out_slots, version)
        finished, kept, prompt_tokens, score_tokens = [], [], 0, 0
        for it, verdict, rows in zip(batch.items, verdicts, scored):
            dropped = it.seq.group in failed
            if dropped:
                self.kv.free(it.slots)
            elif it.seq.score is not None:
                score_tokens += it.num_new
                if self._apply_score(it, rows):
                    finished.append(it.seq)
            else:
                prompt_tokens += max(0, min(it.start + it.num_new, it.seq.num_prompt)
                                     - it.start)
                if self._apply(it, verdict, version):
                    finished.append(it.seq)
            if it.sample:
                kept.append(0 if dropped else len(verdict.emitted.tokens))
        self.journal.add(self, "prompt_tokens_computed", prompt_tokens)
        self.journal.add(self, "score_tokens_computed", score_tokens)
        return finished, failed, kept

    def _verdicts(self, batch: Batch, emitted: list[Emitted], scored: list[ScoreRows | None]):
        sampled = iter(emitted)
        verdicts: list[_Verdict | None] = []
        failed: dict[str, Failure] = {}
        for it, rows in zip(batch.items, scored):
            if rows is not None and not bool(rows.logprobs.isfinite().all()):
                failed[it.seq.group] = Failure(
                    f"logits: the model produced non-finite values (nan/inf) scoring positions "
                    f"{it.start} .. {it.start + it.num_new - 1}", keep_kv=False)
            if not it.sample:
                verdicts.append(None)
                continue
            drawn = next(sampled)
            verdicts.append(self._verdict(it, drawn, failed))
        return verdicts, failed

    def _verdict(self, it: ScheduledSeq, drawn: Emitted, failed: dict[str, Failure]
                 ) -> _Verdict | None:
        """What a sampled item keeps; None, with its request in `failed`, when it fails."""
        seq = it.seq
        if not all(map(math.isfinite, drawn.logprobs)):
            failed[seq.group] = Failure(
                f"logits: the model produced non-finite values (nan/inf) for sample "
                f"{seq.sample_index} at position {it.start + it.num_new - len(it.draft)}",
                keep_kv=False)
            return None
        try:
            kept, reason, text_at = self.stop.check(seq, drawn.tokens)
        except Exception as e:  # the tokenizer is user code
            failed.setdefault(seq.group, Failure(
                f"stop check: {type(e).__name__}: {e}", keep_kv=True))
            return None
        cut = drawn if kept == len(drawn.tokens) else Emitted(
            drawn.tokens[:kept], drawn.logprobs[:kept], drawn.sampling_logprobs[:kept],
            drawn.supports[:kept], drawn.tops[:kept])
        return _Verdict(cut, reason, text_at)

    def _apply(self, it: ScheduledSeq, verdict: _Verdict | None, version: int) -> bool:
        """True when the sequence finished."""
        seq = it.seq
        if verdict is None:  # a prefill chunk short of the prompt's end
            self.kv.advance(seq, it.num_new)
            return False
        # Every kept token but the newest had its K/V computed (as the draft it confirmed);
        # positions of rejected drafts, and of accepted ones past a stop, drop out.
        emitted = verdict.emitted
        kept = it.num_new - len(it.draft) + len(emitted.tokens) - 1
        self.journal.touch(seq)
        self.kv.advance(seq, kept)
        if kept < it.num_new:
            self.kv.free(it.slots[kept:])
        seq.stamp(version)
        seq.token_ids.extend(emitted.tokens)
        params = seq.params
        if params.logprobs:
            seq.logprobs.extend(emitted.logprobs)
            seq.sampling_logprobs.extend(emitted.sampling_logprobs)
        if params.return_support:
            seq.support.extend(emitted.supports)
        if params.top_logprobs:
            seq.top_logprobs.extend(emitted.tops)
        if it.start < seq.num_prompt:
            self.kv.cache_computed(seq)  # the prompt is complete: siblings can share it now
        if verdict.reason is None:
            return False
        seq.stop_text_at = verdict.stop_text_at
        if seq.params.return_routed_experts:
            self._read_routed_experts(seq)
        self.scheduler.finish(seq, verdict.reason)
        return True

    def _apply_score(self, it: ScheduledSeq, rows: ScoreRows | None) -> bool:
        """A scored sequence's chunk: its rows kept; True when its last position ran (its K/V
        then goes to the tree, for the call's sequences that share the prefix)."""
        seq = it.seq
        self.kv.advance(seq, it.num_new)
        if rows is not None:
            seq.score.add(rows, self.journal)
        if seq.num_computed < seq.num_tokens:
            return False
        self.scheduler.finish(seq, "stop")
        return True

    def _read_routed_experts(self, seq: Sequence) -> None:
        """Every position but the newest has K/V, and its slot keeps the routing of the forward
        that computed that K/V (models/layers/moe.py) and that forward's weights version,
        wherever it came from: this sequence's own steps, the prefix cache, a verify step's
        accepted drafts, a recompute after preemption or a weight update, K/V kept across an
        update (carried_kv="park")."""
        slots = self.kv.table.read(seq.row, 0, seq.num_computed)
        # (the journal's snapshot of seq, taken in _apply, undoes it)
        seq.routed_experts = self.kv.pool.read_versioned(ROUTED_EXPERTS, slots)
