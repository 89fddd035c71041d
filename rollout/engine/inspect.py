"""What a user or a test may look at of an engine's state without reaching into its parts:
`Engine.inspect()` returns an `EngineView`, a snapshot taken at the call; `check` is
`Engine.check_invariants()`'s body."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineView:
    sleep_level: int  # 0 awake; 1 or 2 asleep (rollout/colocation/colocation.py)
    needs_weights: bool  # update_weights must refill every weight before generating
    kv_slots: int  # the KV pool's size in tokens (slots of one token's K/V in every layer)
    kv_bytes: int  # bytes of the pool's buffer (0 asleep)
    kv_free: int  # slots on the free list
    kv_available: int  # slots an allocation can get: free, and evictable from the cache
    cached_tokens: int  # slots the prefix cache holds (the radix tree's tokens)
    holds: tuple  # the multi-turn KV holds in place (keys: (request id, sample index))
    kv_sequences: int  # sequences holding KV slots (running, or preempted with K/V kept)
    running: int  # sequences the scheduler runs
    waiting: int  # sequences waiting for admission
    requests: tuple[str, ...]  # ids of the running requests, oldest first
    implementations: dict  # Engine.implementations()


def view(engine) -> EngineView:
    kv, scheduler = engine.kv, engine.scheduler
    return EngineView(
        sleep_level=engine.sleep_level, needs_weights=engine.needs_weights,
        kv_slots=kv.num_slots, kv_bytes=engine.pool.nbytes, kv_free=engine.pool.num_free,
        kv_available=kv.available, cached_tokens=engine.cache.total_size,
        holds=tuple(kv.holds), kv_sequences=len(kv.attached), running=len(scheduler.running),
        waiting=len(scheduler.waiting), requests=tuple(engine.running_requests),
        implementations=engine.implementations())


def current_stats(engine):
    """Engine.stats: its counters, with those its parts keep brought up to date."""
    s = engine._stats
    s.prompt_tokens_computed = engine.committer.prompt_tokens_computed
    s.score_tokens_computed = engine.committer.score_tokens_computed
    s.cache_hit_tokens = engine.kv.cache_hit_tokens
    s.prompt_hit_tokens = engine.kv.prompt_hit_tokens
    s.preemptions = engine.scheduler.num_preemptions
    s.holds_dropped = engine.kv.holds_dropped
    s.parked_bytes = engine.carry.parked_bytes
    s.forward_seconds = engine.runner.forward_seconds
    graphs = engine.runner.graphs
    if graphs is not None:
        s.graph_captures, s.graph_capture_seconds = graphs.captures, graphs.capture_seconds
    line = engine.speculator.cost.line() if engine.speculator else None
    # nan again once the recent steps no longer tell the parts apart (adaptive drafting then
    # goes by the batch-share bar): a line kept from before would show a cost nothing uses.
    s.spec_step_fixed_seconds, s.spec_position_seconds = line or (float("nan"), float("nan"))
    history = engine.speculator.drafter.history if engine.speculator else None
    if history is not None:
        s.draft_history_tokens, s.draft_history_evicted = history.tokens, history.evicted
    return s


def check(engine) -> None:
    """Every slot is in exactly one place (free list, tree, one sequence's private tail); lock
    counts equal the running sequences that pin each node; the queues agree with what holds
    KV; every request's sequences are queued, running or finished; the draft model's pool,
    when speculating with one, likewise. Asleep, nothing is held."""
    scheduler = engine.scheduler
    engine.kv.check()
    scheduler.check()
    queued = {s.seq_id for s in (*scheduler.waiting, *scheduler.running)}
    assert engine.requests.live_sequences() == queued, (
        "requests' sequences differ from those queued or running")
    if engine.is_sleeping:  # carried requests wait, holding no K/V
        assert not scheduler.running and not engine.pool.is_allocated
    else:
        assert engine.carry.parked is None, "awake with K/V still parked"
    if engine.speculator is not None:
        engine.speculator.check_invariants()
