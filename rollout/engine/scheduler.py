"""Every step: admit waiting sequences, chunk prefills, grow decodes, preempt, retire.

Policy only; slots and locks are the KV manager's. Decodes go first, then prefill chunks of
running sequences, then admissions, all within `max_num_batched_tokens`. Admission matches a
sequence's tokens (all but the last, whose logits give the next sample) in the prefix cache,
locks the matched node and allocates slots for the unmatched part only. A sequence whose prompt
shares most of its unmatched part with a prompt another running sequence is still prefilling
waits one round: that prefill is about to be cached, and re-admission then computes only what
is new (n samples, repeated prompts, shared system prefixes all prefill their common tokens
once).

When growth finds no slot even after evicting unlocked leaves, the newest running sequence is
preempted: its computed tokens go into the tree, it unlocks, and it rejoins the front of the
queue, where re-admission hits the cache.

Queue changes are journaled like the KV manager's, so a failed step leaves the queues as they
were (see rollout/journal.py).
"""

from __future__ import annotations

from collections import deque

import torch

from ..config import EngineConfig
from ..kv.manager import KVManager
from ..kv.radix_cache import common_prefix_len
from ..requests.batch import Batch, ScheduledSeq
from ..requests.sequence import SeqStatus, Sequence

# lpm admits the longest cached prefix first: a waiting sequence that shares none would wait as
# long as sequences that do keep coming. Passed over by this many admissions, the oldest
# waiting request goes first.
LPM_PATIENCE = 16


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVManager) -> None:
        self.config, self.kv, self.journal = config, kv, kv.journal
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        # (the oldest waiting request, how many admissions passed it over)
        self._passed: tuple[str | None, int] = (None, 0)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)
        self.journal.record(self.waiting.pop)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # --- scheduling -------------------------------------------------------------------------
    def schedule(self) -> Batch | None:
        budget = self.config.max_num_batched_tokens
        items: list[ScheduledSeq] = []
        preempted = False
        scheduled: set[int] = set()
        decodes, prefills = [], []
        for s in self.running:
            (prefills if s.is_prefilling else decodes).append(s)
        grown = self._grow_decodes(decodes[:budget], items)
        scheduled.update(s.seq_id for s in decodes[:grown])
        budget -= grown
        order = decodes[grown:] + prefills
        for seq in order:
            if budget == 0:
                break
            if seq.status is not SeqStatus.RUNNING:
                continue  # preempted earlier in this loop
            n = min(seq.num_tokens - seq.num_computed, budget)
            slots = self.kv.alloc(n)
            while slots is None:
                victim = self._newest_unscheduled(scheduled)
                self.preempt(victim)
                preempted = True
                if victim is seq:
                    break
                slots = self.kv.alloc(n)
            if slots is None:
                continue
            scheduled.add(seq.seq_id)
            self._schedule_seq(seq, slots, items)
            budget -= n
        # (Checked first: with the batch full, ordering the queue every step costs the host
        # a radix walk per waiting sequence for nothing.)
        if not preempted and self.waiting and self._room(budget):
            budget = self._admit(budget, items)
        if not items:
            return None
        return Batch(items)

    def _grow_decodes(self, decodes: list[Sequence], items: list[ScheduledSeq]) -> int:
        """One slot for each decoding sequence, allocated and written to the table with a
        constant number of device ops (per-sequence ops would make a GPU step launch-bound).
        Returns how many were scheduled: all, or none when the pool is short, and then the
        one-by-one path decides whom to preempt."""
        slots = self.kv.alloc_decodes(len(decodes), decodes) if decodes else None
        if slots is None:
            return 0
        self.kv.place_decodes(decodes, slots)
        items.extend(ScheduledSeq(seq, seq.num_computed, 1, True, None, shared=slots, index=i)
                     for i, seq in enumerate(decodes))
        return len(decodes)

    def _schedule_seq(self, seq: Sequence, slots: torch.Tensor,
                      items: list[ScheduledSeq]) -> None:
        n = slots.numel()
        self.kv.place(seq, seq.num_computed, slots)
        sample = seq.num_computed + n == seq.num_tokens and seq.score is None
        items.append(ScheduledSeq(seq, seq.num_computed, n, sample, slots))

    def _newest_unscheduled(self, scheduled: set[int]) -> Sequence:
        for seq in reversed(self.running):
            if seq.seq_id not in scheduled:
                return seq
        raise RuntimeError("KV pool exhausted by sequences already scheduled this step")

    # --- admission --------------------------------------------------------------------------
    def _oldest(self) -> str:
        """The request that has waited longest: seq ids are drawn in arrival order and kept
        through preemption and restarts, while the queue's order is not its age (preempted
        sequences rejoin its front)."""
        return min(self.waiting, key=lambda s: s.seq_id).group

    def _admission_order(self) -> tuple[list[Sequence], str | None]:
        """(the waiting sequences in admission order, the oldest waiting request where lpm
        orders them: fcfs keeps arrival order, and so no count of who was passed over)."""
        waiting = list(self.waiting)
        if not (self.config.schedule_policy == "lpm" and self.kv.shares_prefixes
                and len(waiting) <= self.config.lpm_max_waiting):
            return waiting, None
        oldest = self._oldest()
        waiting.sort(key=lambda s: -self.kv.prefix_len(s.reusable_tokens()))
        if self._passed == (oldest, LPM_PATIENCE):  # it waited long enough
            waiting.sort(key=lambda s: s.group != oldest)
        return waiting, oldest

    def _count_passed(self, oldest: str | None, admitted: set[Sequence]) -> None:
        """The `oldest` waiting request passed over by this admission (others admitted, none
        of its samples): one more time (up to LPM_PATIENCE). Counted per request: samples
        still waiting after a sibling's admission keep its count and go first too (they wait
        for its prefill, and then would wait LPM_PATIENCE admissions each). Journaled."""
        if oldest is None or not admitted or any(s.group == oldest for s in admitted):
            return
        group, times = self._passed
        passed = (oldest, min(times + 1, LPM_PATIENCE) if group == oldest else 1)
        before, self._passed = self._passed, passed
        self.journal.record(lambda: setattr(self, "_passed", before))

    def _admit(self, budget: int, items: list[ScheduledSeq]) -> int:
        admitted: set[Sequence] = set()
        # Prompts being prefilled now, by group; their prefixes are cached once computed. A
        # sample that only computes its last prompt token (the rest matched) shares nothing.
        in_flight = {s.group: s for s in self.running if s.num_computed < s.num_prompt - 1}
        decode_reserve = len(self.running)
        sharing = self.kv.shares_prefixes
        order, oldest = self._admission_order()
        for seq in order:
            if not self._room(budget):
                break
            if sharing and seq.group in in_flight:
                continue
            reusable = seq.reusable_tokens()
            slots, node = self.kv.match(reusable)
            matched = slots.numel()
            if sharing and self._waits_for(reusable, matched, in_flight):
                continue
            n = min(seq.num_tokens - matched, budget)
            # Leave every running sequence room for its next decode token, or admission
            # would only buy an immediate preemption (the match is locked first: what it
            # pins is not room).
            self.kv.lock(node)
            # the lock just taken pins the tokens the turn's own hold kept: it goes first
            # (and stays if the turn is not admitted)
            if not self.kv.make_room(n + decode_reserve, release=seq.resume_key):
                self.kv.unlock(node)
                break
            self._resumed(seq)
            new = self.kv.alloc(n)
            self.kv.attach(seq, slots, node)
            self._run(seq)
            admitted.add(seq)
            self._schedule_seq(seq, new, items)
            budget -= n
            decode_reserve += 1
            if seq.num_computed < seq.num_prompt - 1:
                in_flight.setdefault(seq.group, seq)
        self._count_passed(oldest, admitted)
        if admitted:
            before = self.waiting
            self.waiting = deque(s for s in before if s not in admitted)
            self.journal.record(lambda: setattr(self, "waiting", before))
        return budget

    def _resumed(self, seq: Sequence) -> None:
        """`seq`'s admission released the hold it resumes: for every sample of its request,
        which all name it. The ones still waiting forget it, so that neither their admission
        nor their end releases it again: a request whose id was used before (ids are free
        again once returned) holds its finished samples' K/V under the very keys it resumes,
        and a sibling's hold would go. Journaled."""
        key = seq.resume_key
        if key is None:
            return
        for sample in self.waiting:  # (`seq` among them until the admission ends)
            if sample.group == seq.group:
                sample.resume_key = None
                self.journal.record(lambda s=sample: setattr(s, "resume_key", key))

    def _room(self, budget: int) -> bool:
        """Whether a waiting sequence could be admitted: tokens left in the step's budget, a
        sequence and a slot-table row to spare."""
        return (budget > 0 and len(self.running) < self.config.max_num_seqs
                and self.kv.table.num_free_rows > 0)

    def _run(self, seq: Sequence) -> None:
        self.journal.touch(seq)
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)
        self.journal.record(self.running.pop)

    @staticmethod
    def _waits_for(reusable: list[int], matched: int, in_flight: dict[str, Sequence]) -> bool:
        """True when a prompt being prefilled covers at least half of what a sequence could
        take from the cache (`reusable`, of which `matched` is cached) and would compute."""
        todo = len(reusable) - matched
        if todo <= 0:
            return False
        for other in in_flight.values():
            if other.prompt_ids[0] != reusable[0]:
                continue
            shared = common_prefix_len(other.prompt_ids, reusable, 0)
            if 2 * (shared - matched) >= todo:
                return True
        return False

    # --- retiring ---------------------------------------------------------------------------
    def _stop_running(self, seq: Sequence, keep_kv: bool, hold_key=None) -> None:
        self.kv.release(seq, keep_kv, hold_key)
        i = self.running.index(seq)
        del self.running[i]
        self.journal.record(lambda: self.running.insert(i, seq))

    def preempt(self, seq: Sequence, counted: bool = True) -> None:
        """`counted`: a preemption for memory (not a retraction before sleep: carry.py)."""
        self._stop_running(seq, keep_kv=True)
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        self.journal.record(self.waiting.popleft)
        if counted:
            self.journal.add(self, "num_preemptions", 1)

    def finish(self, seq: Sequence, reason: str, keep_kv: bool = True) -> None:
        """`seq` ends with `reason`: running, it gives its K/V up (to the tree when
        `keep_kv`, held there if it asked to be and did not abort); waiting, it leaves the
        queue."""
        self.journal.touch(seq)
        if seq.resume_key is not None:
            self.kv.unhold(seq.resume_key)  # ended before it was admitted
        if seq.status is SeqStatus.RUNNING:
            self._stop_running(seq, keep_kv, None if reason == "abort" else seq.hold_key)
        elif seq.status is SeqStatus.WAITING:
            i = self.waiting.index(seq)
            del self.waiting[i]
            self.journal.record(lambda: self.waiting.insert(i, seq))
        seq.status, seq.finish_reason = SeqStatus.FINISHED, reason

    # --- inspection -------------------------------------------------------------------------
    def check(self) -> None:
        """The queues agree with the KV manager: running sequences are exactly the attached
        ones; waiting ones hold nothing."""
        assert all(s.status is SeqStatus.RUNNING for s in self.running)
        assert {s.seq_id for s in self.running} == set(self.kv.attached), \
            "running sequences differ from those holding KV"
        assert all(s.status is SeqStatus.WAITING and s.row == -1 for s in self.waiting)
        assert len({s.seq_id for s in self.waiting}) == len(self.waiting), "queued twice"
