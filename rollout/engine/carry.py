"""Carry: groups that outlive the call that started them (partial rollouts).

`Engine.rollout` returns as soon as enough groups are complete; the others stay in the engine,
carried into the next call. They survive `sleep` and `update_weights`: first every running
sequence is retracted (its K/V goes to the prefix cache, which sleep and a weight update then
empty; it waits again with its tokens, logprobs and versions, and a weight update keeps the
routes of that K/V for a sample that asked for them: keep_routes), and after wake-up admission
re-prefills prompt + tokens so far, under whatever weights the engine then holds: siblings share
their prompt through the radix cache as at first admission. Because the sampling noise is a
function of (seed, position, token), a group carried under unchanged weights draws what an
uninterrupted run draws.

With EngineConfig(carried_kv="park") a sample carried mid-way keeps its K/V instead: sleep
parks what the prefix cache holds for it on the host and wake-up writes it back (rollout/kv/
parked.py), so re-admission computes its newest token only; a weight update keeps that K/V in the
cache under a tag of the sample's (Sequence.kv_tag) where no fresh request can match it, and
the sample goes on from the old weights' K/V (the "keep the stale KV" mode of SGLang's and
slime's partial rollouts).

Every token is stamped with the weights version it was sampled under (Sequence.versions). After
an update, `EngineConfig.max_staleness` bounds how old a carried group's oldest token may be;
`stale_groups` says what happens to an older one: "restart" from its prompt (same seeds), "drop"
(it is aborted and its output discarded) or "keep". Every change goes through the journal, so a
failed unit leaves requests, queues and sequences as they were.
"""

from __future__ import annotations

import torch

from ..fields import as_int
from ..journal import Journal, RollbackFailed
from ..kv import parked
from ..kv.manager import KVManager
from ..models.base import ROUTED_EXPERTS
from ..requests.request import Request
from ..requests.sequence import SeqStatus
from .requests import RequestTable
from .scheduler import Scheduler
from .stats import EngineStats


class Carry:
    def __init__(self, scheduler: Scheduler, requests: RequestTable, kv: KVManager,
                 journal: Journal, stats: EngineStats, carried_kv: str = "recompute") -> None:
        """`carried_kv`: EngineConfig.carried_kv, what a sample carried mid-way resumes from."""
        self.scheduler, self.requests, self.kv = scheduler, requests, kv
        self.journal, self.stats = journal, stats
        self.parks = carried_kv == "park"
        self.parked: parked.ParkedKV | None = None  # while asleep, with carried_kv="park"
        # The weights version whose staleness bound every group not yet handed out is known to
        # meet (a group's oldest version never falls, so it holds until the version moves):
        # step() and rollout() then skip the scan. Journaled with the restarts it follows.
        self.bounded_at: int | None = None
        # The update under way: samples its forget_cache let go on from kept K/V, and whether
        # it had to drop that K/V (begin_update resets both).
        self.kept_now, self.kept_lost = 0, False

    # --- across sleep and weight updates ----------------------------------------------------
    def retract(self) -> None:
        """Every running sequence gives its K/V up and waits again, keeping its tokens, in the
        order it ran (the oldest is re-admitted first)."""
        with self.journal.unit():
            running = list(self.scheduler.running)
            for seq in reversed(running):
                self.scheduler.preempt(seq, counted=False)
            self.journal.add(self.stats, "retracted", len(running))

    def _mid_sample(self):
        """Waiting samples with tokens of their own: those whose K/V parking keeps."""
        return [s for s in self.scheduler.waiting if s.versions]

    def park(self) -> None:
        """Before sleep drops the pool (carried_kv="park"; after retract): what the prefix
        cache holds for each sample carried mid-way goes to the host. A sleep that deepens
        (level 1 to 2) has parked already."""
        if not self.parks or self.parked is not None or not self.kv.pool.is_allocated:
            return
        self.parked = parked.park(self.kv, [s.reusable_tokens() for s in self._mid_sample()])

    def unpark(self) -> None:
        """After wake-up brought the pool back: the parked K/V into the prefix cache, in one
        journal unit (a failure leaves it parked)."""
        if self.parked is None:
            return
        with self.journal.unit():
            parked.unpark(self.kv, self.parked)
            self.journal.add(self.stats, "parked_tokens", self.parked.num_tokens)
        self.parked = None

    @property
    def parked_bytes(self) -> int:
        return 0 if self.parked is None else self.parked.nbytes

    def forget_cache(self) -> None:
        """The weights changed: the prefix cache's K/V came from the old ones and goes, but
        for the samples carried mid-way with carried_kv="park", which go on from theirs
        under a tag (KVManager.keep_stale). Should that fail, everything goes: no K/V of
        the old weights may stay where a fresh request could match it."""
        if self.parks:
            try:
                with self.journal.unit():
                    kept = self.kv.keep_stale(self._mid_sample())
                    self.journal.add(self.stats, "stale_kv_kept", kept)
                self.kept_now = kept
                return
            except BaseException:
                # What every rank does when any rank lost it (drop_kept_kv): tags an earlier
                # update set go too, their K/V cleared with the cache
                self.kept_lost = True
                self.drop_kept_kv()
                raise
        # One unit: a clear that fails leaves no routes kept, and the retry keeps them once.
        with self.journal.unit():
            self.keep_routes()
            self.kv.clear_cache()

    def keep_routes(self) -> None:
        """carried_kv="recompute", before the update's clear: each sample carried mid-way that
        asked for routes keeps those of its K/V the prefix cache still holds (its rows'
        routed experts and versions, models/layers/moe.py, kv/pool.py), which its tokens so
        far were sampled under; its re-prefill computes new ones (docs/moe.md)."""
        if not self.kv.pool.keeps_versions:
            return
        held = [(seq, self.kv.cache.peek(seq.reusable_tokens())) for seq in self._mid_sample()
                if seq.params.return_routed_experts]
        held = [(seq, slots) for seq, slots in held if slots.numel()]
        if not held:
            return
        # Every sample's slots in one read: each device-to-host copy waits for the device.
        sizes = [slots.numel() for _, slots in held]
        routes, versions = self.kv.pool.read_versioned(
            ROUTED_EXPERTS, torch.cat([slots for _, slots in held]))
        for (seq, _), r, v in zip(held, routes.split(sizes), versions.split(sizes)):
            self.journal.touch(seq)
            # Copies: a view would keep every sample's routes alive while any one is held.
            seq.earlier_routes += ((r.clone(), v.clone()),)

    def begin_update(self) -> None:
        """A weight update starts (whether or not it gets as far as forget_cache)."""
        self.kept_now, self.kept_lost = 0, False

    def drop_kept_kv(self) -> None:
        """Some rank of a tensor-parallel engine had its forget_cache fail: every rank drops
        what that one dropped (the cache, the kept K/V of samples carried mid-way and their
        tags), so the ranks schedule those samples alike (each re-prefills); ranks that had
        kept it would otherwise resume from it and step apart."""
        self.kv.clear_cache()
        for seq in self._mid_sample():
            seq.kv_tag = None
        self.stats.stale_kv_kept -= self.kept_now  # (kept by this update, and lost)
        self.kept_now = 0

    def enforce_staleness(self, version: int, max_staleness: int | None, policy: str) -> None:
        """After weights `version` came in: every group still to be handed out whose oldest
        token is more than `max_staleness` versions old is restarted, dropped or kept."""
        if max_staleness is None or policy == "keep" or version == self.bounded_at:
            return  # the usual case at every step(): no scan
        stale = [r for r in self._unreturned()
                 if any(s.oldest_version is not None and version - s.oldest_version > max_staleness
                        for s in r.seqs)]
        with self.journal.unit():
            for request in stale:
                if policy == "restart":
                    self._restart(request)
                else:
                    self.drop(request)
            if stale:
                self.journal.add(self.stats, f"stale_{policy}s", len(stale))
            before, self.bounded_at = self.bounded_at, version
            self.journal.record(lambda: setattr(self, "bounded_at", before))

    def _unreturned(self) -> list[Request]:
        """Groups running, and groups complete but not yet handed out: rollout()'s, and
        streaming requests that completed while generate() or rollout() stepped (step() has yet
        to return them)."""
        return [*self.requests.running.values(), *self.requests.ready.values()]

    def _restart(self, request: Request) -> None:
        """Every sample of the group goes back to its prompt (it keeps its seed)."""
        if request.request_id in self.requests.ready:
            self.requests.take_ready(request.request_id)
            self.requests.start(request)
        error = request.error
        request.error = None
        self.journal.record(lambda: setattr(request, "error", error))
        for seq in request.seqs:
            if seq.status is SeqStatus.RUNNING:  # (update_weights retracts every one first)
                self.scheduler.preempt(seq, counted=False)
            finished = seq.is_finished
            if finished:
                self.kv.unhold(seq.hold_key)
            self.journal.touch(seq)
            seq.restart()
            if finished:
                self.scheduler.add(seq)

    def drop(self, request: Request, keep_kv: bool = False) -> None:
        """The group ends without an output: running, it is aborted (its K/V to the prefix
        cache when `keep_kv`, else freed); complete, its output is discarded (and its KV
        holds released)."""
        if self.requests.take_ready(request.request_id) is not None:
            for seq in request.seqs:
                self.kv.unhold(seq.hold_key)
            return
        self.abort(request, keep_kv)

    def abandon(self, request_ids: list[str], failure: BaseException) -> None:
        """A call that failed (with `failure`) gives its requests up (nobody will collect their
        outputs): what still runs is aborted, K/V to the prefix cache, or freed should that
        fail too. After a RollbackFailed nothing is touched: the bookkeeping is unknown, the
        engine refuses every later call, and an error here would hide why."""
        if isinstance(failure, RollbackFailed):
            return
        for request_id in request_ids:
            self.requests.ready.pop(request_id, None)
            request = self.requests.running.get(request_id)
            if request is None:
                continue
            try:
                with self.journal.unit():
                    self.abort(request, keep_kv=True)
            except RollbackFailed:
                raise
            except Exception:
                with self.journal.unit():
                    self.abort(request, keep_kv=False)

    def abort(self, request: Request, keep_kv: bool) -> None:
        """A running request ends: its unfinished samples abort, their K/V to the prefix cache
        (`keep_kv`) or freed; its finished samples' KV holds go (their output is never
        returned, so no one resumes them)."""
        self.requests.end(request)
        for seq in request.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq, "abort", keep_kv)
            else:
                self.kv.unhold(seq.hold_key)

    # --- what rollout() hands out -----------------------------------------------------------
    def groups_wanted(self, groups, new: int) -> int:
        """rollout()'s `groups` checked against what there is: carried groups + `new` prompts
        (None: all of them)."""
        available = len(self.carried()) + new
        groups = available if groups is None else as_int("groups", groups, 0)
        if groups > available:
            raise ValueError(f"groups: {groups} asked for, but there are only {available} "
                             f"({available - new} carried + {new} prompts)")
        return groups

    def hand_out(self, handed: list[Request], abort_rest: bool) -> None:
        """`handed` leave the engine; with `abort_rest`, every other rollout group ends too."""
        for request in handed:
            self.requests.take_ready(request.request_id)
        if abort_rest:
            for request in self.carried():
                self.drop(request, keep_kv=True)

    def num_complete(self) -> int:
        return sum(r.from_rollout for r in self.requests.ready.values())

    def complete(self) -> list[Request]:
        """Rollout groups complete and not yet handed out, oldest first."""
        return sorted((r for r in self.requests.ready.values() if r.from_rollout), key=_age)

    def carried(self) -> list[Request]:
        """Rollout groups not yet handed out, complete or not, oldest first."""
        return sorted((r for r in self._unreturned() if r.from_rollout), key=_age)


def _age(request: Request) -> int:
    # Sequence ids count up across the engine's life: the first one orders requests by arrival.
    return request.seqs[0].seq_id
