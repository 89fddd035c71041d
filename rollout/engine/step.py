"""One engine step as a transaction: schedule (one journal unit), propose drafts, prepare, run
the forward and sample (changing no bookkeeping, so Ctrl-C may land there at once; under tensor
parallelism it waits for the next step's batch check, which every rank stops at), commit (one
more unit). Whatever is raised where, the step's new slots go back (`discard_pending`) and the
engine is as it was after its last complete unit."""

from __future__ import annotations

import contextlib
import time
from itertools import accumulate

import torch

from ..journal import RollbackFailed
from ..parallel import check_same_batch, check_same_tokens
from ..requests.sequence import Sequence
from ..sample.sampler import Emitted, SamplingBatch
from ..sample.top import attach_tops
from ..score.rows import ScoreInputs
from ..score.state import ScoreRows
from .commit import Committer, Failure
from .guard import EngineGuard
from .requests import RequestTable
from .scheduler import Scheduler
from .stats import EngineStats


def by_item(scored: ScoreRows | None, rows: ScoreInputs | None,
            num_items: int) -> list[ScoreRows | None]:
    """A step's scored rows split by item (None for an item without any)."""
    if scored is None:
        return [None] * num_items
    bounds = [0, *accumulate(rows.counts)]
    return [scored[a:b] if b > a else None for a, b in zip(bounds, bounds[1:])]


class StepRunner:
    def __init__(self, stack, scheduler: Scheduler, committer: Committer, speculator,
                 requests: RequestTable, guard: EngineGuard, stats: EngineStats,
                 tp=None, check_tokens: bool = False) -> None:
        """`tp`: the tensor-parallel group of an engine of several ranks (None: one), whose
        ranks must run the same batch every step (checked before the forward) and, with
        `check_tokens` (EngineConfig.check_tensor_parallel), sample the same tokens. Nothing
        here refers back to the engine (a cycle would keep a dropped engine's pool alive
        until the garbage collector ran)."""
        self.kv, self.runner, self.sampler = stack.kv, stack.runner, stack.sampler
        self.device, self.journal = stack.device, stack.kv.journal
        self.scheduler, self.committer, self.speculator = scheduler, committer, speculator
        self.requests, self.guard, self.stats = requests, guard, stats
        self.tp, self.check_tokens = tp, check_tokens

    def run(self) -> bool:
        """One scheduler step; False when nothing could be scheduled."""
        marks = [time.perf_counter()]
        try:
            with self.journal.unit():
                batch = self.scheduler.schedule()
            if batch is None:
                return False
            if self.tp is not None:
                self._agree_on_batch(batch)
            marks.append(time.perf_counter())
            speculating = self.speculator is not None and self.speculator.propose(batch) > 0
            marks.append(time.perf_counter())
            inputs = self.runner.prepare(batch)
            marks.append(time.perf_counter())
            # Nothing below changes bookkeeping until the commit: Ctrl-C may land at once,
            # but for a rank of several, held through the forward's collectives.
            with self._interruptible():
                logits, scored = self.runner.run(inputs)
                marks.append(time.perf_counter())
                items = [it for it in batch.items if it.sample]
                emitted = self._sample_items(logits, items, speculating)
                if self.check_tokens:
                    check_same_tokens([e.tokens for e in emitted], self.tp, self.device)
            marks.append(time.perf_counter())
            with self.journal.unit():
                finished, failed, kept = self.committer.commit(
                    batch, emitted, by_item(scored, inputs.score, len(batch.items)))
                if speculating:
                    verified = self.speculator.after_commit(batch, emitted, kept)
                for request_id, failure in failed.items():
                    self._fail(request_id, failure)
                self._retire(finished, failed)
                self.kv.settle()
            marks.append(time.perf_counter())
        except BaseException:
            self._discard_pending()
            raise
        if self.speculator is not None:
            self.stats.spec_skipped_steps += self.speculator.skipped
        if speculating:
            self.stats.spec_steps += 1
            self.stats.record_verified(verified)
        # What the samples kept: accepted drafts past a stop or the length were never theirs.
        self.stats.record_step(batch, sum(kept), tuple(marks))
        if self.speculator is not None and self.tp is None:
            # Forward and sampling: what a verified position adds to, against the positions
            # run. Not under tensor parallelism: the ranks' clocks differ and their drafts must
            # not (they keep the batch-share bar, spec/cost.py).
            self.speculator.observe_step(sum(it.num_new for it in batch.items),
                                         marks[5] - marks[3])
        return True

    def _interruptible(self):
        """One rank of one engine lets Ctrl-C through in the forward (rolled back at once). A
        rank of several holds it to the next step's batch check (_agree_on_batch), or to the
        call's end: raised mid-forward, it had left the other ranks in the forward's
        collectives, which the retry's collectives then met (gloo aborts the process on such a
        mismatch)."""
        return self.guard.allow_interrupts() if self.tp is None else contextlib.nullcontext()

    def _agree_on_batch(self, batch) -> None:
        """The ranks run the same batch (check_same_batch), and stop together before the
        forward at an interrupt held on any of them."""
        self.stop_together(lambda held: check_same_batch(batch, self.tp, self.device, held),
                           "before this step's forward")

    def stop_together(self, check, where: str) -> None:
        """Under tensor parallelism, at a point no rank may leave alone: an interrupt held on
        any rank stops every rank here, that rank raising it and the others RuntimeError (so a
        retry on every rank meets no collective left half done). `check(held)`: the ranks'
        collective, told whether this rank holds one, returning whether any does."""
        held = self._held_interrupt()
        try:
            interrupted = check(held is not None)
        except RuntimeError:
            if held is not None:
                raise held from None
            raise
        if held is not None:
            raise held
        if interrupted:
            raise RuntimeError(f"another rank of this tensor-parallel engine was interrupted "
                               f"(Ctrl-C); every rank stopped {where}")

    def _held_interrupt(self) -> BaseException | None:
        """An interrupt held so far, delivered now (the caller's SIGINT handler runs): what it
        raised, kept to raise once the ranks agree; None if none was held or the handler
        raised nothing."""
        try:
            self.guard.deliver_held()
        except BaseException as e:
            return e
        return None

    def _discard_pending(self) -> None:
        try:
            self.kv.discard_pending()
            if self.speculator is not None:
                self.speculator.discard_pending()
        except BaseException as e:
            raise RollbackFailed("discarding a failed step's slots") from e

    def _sample_items(self, logits: torch.Tensor, items, speculating: bool) -> list[Emitted]:
        """What each sampled item emits (verification's accepted drafts plus one)."""
        # One row per sampled position: a verifying item has len(draft) + 1 of them.
        positions = [(it.seq, j) for it in items for j in range(len(it.draft) + 1)]
        rows = SamplingBatch.for_sequences(positions, self.device)
        want_support = tuple(seq.params.return_support for seq, _ in positions)
        if speculating:
            emitted = self.speculator.verify(logits, rows, items, want_support)
        else:
            want_logprobs = tuple(seq.params.logprobs for seq, _ in positions)
            emitted = self.sampler.draw(logits, rows, want_support, want_logprobs)
        attach_tops(logits, positions, emitted, [len(it.draft) + 1 for it in items])
        return emitted

    def _fail(self, request_id: str, failure: Failure) -> None:
        """The request ends as aborted, saying why; the other requests go on."""
        request = self.requests.running[request_id]
        error = request.error
        request.error = failure.error
        self.journal.record(lambda: setattr(request, "error", error))
        for seq in request.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq, "abort", failure.keep_kv)

    def _retire(self, finished: list[Sequence], failed: dict[str, Failure]) -> None:
        """Requests whose last sample finished this step wait in `requests.ready`, with the
        weights version they completed under (their output's, however late it is handed
        out)."""
        for request_id in dict.fromkeys([*(s.group for s in finished), *failed]):
            request = self.requests.running[request_id]
            if request.done:
                self.requests.end(request, finished=True)
                before = request.completed_version
                request.completed_version = self.committer.weights_version()
                self.journal.record(lambda r=request, v=before: setattr(r, "completed_version",
                                                                         v))
