"""The draft history under the journal: a fault (RuntimeError, KeyboardInterrupt) before or
after any of its changes inside a unit (an addition, an eviction, a compaction, a reservation)
leaves the history exactly as it was, and it goes on as one that never failed; in the engine a
failed flush of finished samples neither loses nor repeats any of them."""

from __future__ import annotations

from array import array
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from models import tiny_model
from test_faults import Fault

import rollout.spec.history
from rollout import Engine, EngineConfig, SamplingParams, SpeculativeConfig
from rollout.journal import Journal
from rollout.spec.history import DraftHistory

MIN, MAX = 2, 5
POINTS = ("add", "_evict_oldest", "_compact", "_reserve")


def held(history: DraftHistory):
    """What the history holds, named without its offsets or entry ids: the entries oldest
    first, each gram's live places as (entry's rank, place in the entry), the counters."""
    rank = {eid: r for r, eid in enumerate(history.entries)}
    starts = sorted((start, eid) for eid, (start, _) in history.entries.items())

    def place(offset):
        start, eid = next((s, e) for s, e in reversed(starts) if s <= offset)
        return rank[eid], offset - start

    def index(ix):
        named = {gram: [place(o) for o in history._live_offsets(offsets).tolist()]
                 for gram, offsets in ix.items()}
        return {gram: places for gram, places in named.items() if places}
    return ([(history.prompt_of[e], history._flat[s:s + n].tolist())
             for e, (s, n) in history.entries.items()],
            index(history.global_index),
            {key: index(ix) for key, ix in history.prompt_index.items()},
            history.tokens, history.evicted, dict(history.prompt_entries))


samples_st = st.lists(st.tuples(st.sampled_from([(1,), (2, 2), (3,)]),
                                st.lists(st.integers(0, 3), min_size=1, max_size=12)),
                      min_size=1, max_size=8)


def add_all(history: DraftHistory, samples) -> None:
    for prompt, completion in samples:
        history.add(list(prompt), completion)


def faulted_unit(history: DraftHistory, samples, point: str, fault: Fault) -> None:
    """add_all in a unit of the history's journal, `fault` at its `point`."""
    setattr(history, point, fault.wrap(getattr(history, point)))
    try:
        with history.journal.unit():
            add_all(history, samples)
    finally:
        delattr(history, point)


@pytest.fixture(scope="module")
def compacting():
    """Compaction (normally once the evicted places outnumber the held ones by 1024) after a
    few evictions, so units fail inside it and after it."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(rollout.spec.history, "COMPACT_SLACK", 4)
        yield


@settings(max_examples=150, deadline=None)
@given(before=samples_st, unit=samples_st, point=st.sampled_from(POINTS), at=st.integers(1, 6),
       after=st.booleans(), kind=st.sampled_from([RuntimeError, KeyboardInterrupt]),
       budget=st.integers(12, 60))
def test_a_failed_unit_leaves_the_history_as_it_was(compacting, before, unit, point, at, after,
                                                     kind, budget):
    history, twin = DraftHistory(budget, MIN, MAX, Journal()), DraftHistory(budget, MIN, MAX)
    add_all(history, before)
    add_all(twin, before + unit)
    was = held(history)
    fault = Fault(kind, at=at, after=after)
    try:
        faulted_unit(history, unit, point, fault)
    except kind:
        history.check()
        assert held(history) == was
        add_all(history, unit)  # as if it had never failed
    else:
        assert not fault.fired  # the unit made fewer calls: it committed
    history.check()
    assert held(history) == held(twin)


@pytest.mark.parametrize("grows", [False, True], ids=["evicts_and_compacts", "grows"])
def test_every_call_of_a_unit_can_fail(compacting, grows):
    """A fixed unit that evicts and compacts (or, under a large budget, outgrows the buffer),
    faulted before and after each call of each point in turn: every time the history is as it
    was, and then as if it had never failed."""
    budget, count = (4000, 120) if grows else (20, 4)

    def build():
        history = DraftHistory(budget, MIN, MAX, Journal())
        add_all(history, [((i % 2,), [1, 2, 3, i % 4, 0, 1]) for i in range(6)])
        return history
    unit = [((i % 3,), [2, 3, i % 4, 1, 0, i % 5, 2]) for i in range(count)]
    done, calls = build(), Counter()
    size = len(done._flat)
    for point in POINTS:
        setattr(done, point, counted(getattr(done, point), calls, point))
    add_all(done, unit)
    if grows:
        assert len(done._flat) > size and not done.evicted
    else:
        assert calls["_evict_oldest"] >= 3 and done.evicted >= 3 and len(done._flat) == size
        assert done._used < max(s + n for s, n in done.entries.values()) + 20  # it compacted
    for point in POINTS:
        for at in range(1, calls[point] + 1):
            for after in (False, True):
                history = build()
                was = held(history)
                with pytest.raises(KeyboardInterrupt):
                    faulted_unit(history, unit, point, Fault(KeyboardInterrupt, at, after))
                history.check()
                assert held(history) == was, (point, at, after)
                add_all(history, unit)
                assert held(history) == held(done)


def counted(fn, calls: Counter, name: str):
    def wrapper(*args, **kwargs):
        calls[name] += 1
        return fn(*args, **kwargs)
    return wrapper


# --- in the engine ---------------------------------------------------------------------------

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16]]


@pytest.mark.parametrize("point", ["flush", "history_add"])
@pytest.mark.parametrize("after", [False, True], ids=["before", "after"])
def test_a_failed_flush_adds_all_of_its_samples_or_none(point, after, monkeypatch):
    """Finished samples wait for the next step's proposal to enter the history; a fault there
    fails that step. At the flush's call: before it, the samples enter at the next step; after
    it, they are in. At its 2nd addition: the flush is undone and its samples dropped (they
    only feed drafts), none half in or twice. Later samples enter as before."""
    def engine():
        return Engine(tiny_model("llama"), EngineConfig(
            kv_cache_tokens=2048, max_model_len=64, seed=0, batch_invariant=True,
            speculative=SpeculativeConfig(method="suffix", num_speculative_tokens=3)))

    def bag(e):  # the history's entries, in whatever order drafting let them finish
        return Counter(map(repr, held(e.speculator.drafter.history)[0]))
    params = [SamplingParams(n=3, temperature=1.0, max_tokens=10, seed=s, ignore_eos=True)
              for s in (1, 2, 3)]
    faulty, clean = engine(), engine()
    for e in (faulty, clean):
        e.generate(PROMPTS, params[0])
    clean.speculator.drafter.flush()
    first = bag(clean)  # the first call's 9 samples
    was = bag(faulty)  # those that finished before its last step; the others wait
    assert len(faulty.speculator.drafter._pending) >= 2 and sum(first.values()) == 9
    obj = faulty.speculator.drafter if point == "flush" else faulty.speculator.drafter.history
    fault = Fault(RuntimeError, at=1 if point == "flush" else 2, after=after)
    fault.install(monkeypatch, obj, "flush" if point == "flush" else "add")
    with pytest.raises(RuntimeError, match="injected"):
        faulty.generate(PROMPTS, params[1])
    monkeypatch.undo()
    faulty.check_invariants()
    assert not faulty.running_requests
    for e in (faulty, clean):
        e.generate(PROMPTS, params[2])
        e.speculator.drafter.flush()
        e.check_invariants()
    third = bag(clean) - first
    assert sum(third.values()) == 9
    assert bag(faulty) == third + (was if point == "history_add" else first)


def test_finished_samples_enter_at_the_next_step_whatever_its_batch():
    """Even a step that drafts nothing (a prefill, or more decoding samples than
    max_batch_size) takes the waiting samples into the history."""
    engine = Engine(tiny_model("llama"), EngineConfig(
        kv_cache_tokens=2048, max_model_len=64, seed=0,
        speculative=SpeculativeConfig(method="suffix", max_batch_size=1)))
    params = SamplingParams(n=3, temperature=1.0, max_tokens=10, seed=1)
    engine.generate(PROMPTS, params)
    history = engine.speculator.drafter.history
    assert not history.entries
    for prompt in PROMPTS:
        engine.add_request(prompt, params)
    engine.step()  # prefills only
    assert len(history.entries) == 9
    skipped = engine.stats.spec_skipped_steps
    engine.step()  # 9 decoding samples: no drafts
    assert engine.stats.spec_skipped_steps == skipped + 1
    history.check()


class Appends(array):
    """An index's offsets that fail to grow at the `at`-th append of all (out of memory, or
    its buffer pinned by a view that something still holds)."""
    fault: Fault | None = None

    def append(self, offset: int) -> None:
        fault = Appends.fault
        if fault is not None:
            fault.calls += 1
            if fault.calls == fault.at:
                raise fault.kind("injected fault")
        super().append(offset)


@pytest.mark.parametrize("kind", [MemoryError, KeyboardInterrupt])
def test_an_addition_failing_halfway_is_undone(compacting, kind, monkeypatch):
    """A unit whose addition fails partway through its offsets (at each of them in turn): the
    history is as it was, and then as if it had never failed."""
    monkeypatch.setattr(rollout.spec.history, "array", Appends)

    def build():
        history = DraftHistory(20, MIN, MAX, Journal())
        add_all(history, [((i % 2,), [1, 2, 3, i % 4, 0, 1]) for i in range(6)])
        return history
    unit = [((i % 3,), [2, 3, i % 4, 1, 0, i % 5, 2]) for i in range(4)]
    done = build()
    Appends.fault = counting = Fault(kind, at=0, after=False)
    try:
        add_all(done, unit)
        for at in range(1, counting.calls + 1):
            Appends.fault = None
            history = build()
            was = held(history)
            Appends.fault = Fault(kind, at, after=False)
            with pytest.raises(kind), history.journal.unit():
                add_all(history, unit)
            Appends.fault = None
            history.check()
            assert held(history) == was, at
            add_all(history, unit)
            assert held(history) == held(done)
    finally:
        Appends.fault = None
