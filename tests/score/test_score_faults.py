"""Faults (RuntimeError, KeyboardInterrupt) injected at every point of a score() call: its
queueing, the rows' computation, their commit, a round's end, and the step points it shares
with generation. Afterwards the invariants hold, nothing runs, and the same call returns what a
fresh engine returns."""

from __future__ import annotations

import pytest
import test_faults
from test_faults import PARAMS, PROMPTS, Fault, assert_clean, drain, make, view

import rollout.engine.score as engine_score
import rollout.executor.runner as runner
from rollout.score.plan import ScorePlan
from rollout.score.state import ScoreState

VOCAB = len(test_faults.TOK)
PROMPT = [(7 * i) % VOCAB for i in range(14)]
# Completions of one prompt (rows shared: two rounds), a longer one (chunks), a prefix.
SEQUENCES = [PROMPT + [(3 * i + j) % VOCAB for i in range(9)] for j in range(3)] + \
    [[(5 * i + 1) % VOCAB for i in range(33)], PROMPT[:9]]

POINTS = {
    "queue": (lambda e: (engine_score, "_queue"), True),
    "schedule": (lambda e: (e.scheduler, "schedule"), True),
    "alloc": (lambda e: (e.kv, "alloc"), False),
    "forward": (lambda e: (e.model, "forward"), True),
    "score_rows": (lambda e: (runner, "score_rows"), True),
    "commit": (lambda e: (e.committer, "commit"), True),
    "rows_added": (lambda e: (ScoreState, "add"), True),
    "finish": (lambda e: (e.scheduler, "finish"), False),
    "radix_insert": (lambda e: (e.cache, "insert"), True),
    "round_done": (lambda e: (ScorePlan, "finish"), True),
    "round_taken": (lambda e: (ScoreState, "rows"), True),  # every request of the round done
}
CASES = [pytest.param(point, after, id=f"{point}-{'after' if after else 'before'}")
         for point, (_, has_after) in POINTS.items() for after in (False, True)[:1 + has_after]]


def scores(engine):
    return [(o.logprobs, o.top.ids.tolist()) for o in engine.score(SEQUENCES, top_logprobs=2)]


@pytest.mark.parametrize("kind", [RuntimeError, KeyboardInterrupt], ids=["error", "interrupt"])
@pytest.mark.parametrize("point,after", CASES)
def test_fault_while_scoring_leaves_the_engine_exact(point, after, kind, monkeypatch):
    engine = make("plain", True)
    fault = Fault(kind, at=2, after=after)
    fault.install(monkeypatch, *POINTS[point][0](engine))
    with pytest.raises(kind, match="injected"):
        engine.score(SEQUENCES, top_logprobs=2)
    assert fault.fired
    monkeypatch.undo()
    assert_clean(engine)
    got, want = scores(engine), scores(make("plain", True))
    assert [ids for _, ids in got] == [ids for _, ids in want]
    for (a, _), (b, _) in zip(got, want):
        assert a == pytest.approx(b, abs=1e-5)
    assert_clean(engine)


@pytest.mark.parametrize("kind", [RuntimeError, KeyboardInterrupt], ids=["error", "interrupt"])
def test_a_round_that_finished_takes_its_requests_itself(kind, monkeypatch):
    """A failed round's cleanup (Carry.abandon) had also run after every round that finished,
    to take its requests out of the engine: a fault there left them finished in it, and the
    next step() handed them to the caller as streaming outputs. A streaming request queued
    before the call finishes as it would have."""
    engine = make("plain", True)
    stream = engine.add_request(PROMPTS[1], PARAMS[1])
    Fault(kind, at=1, after=False).install(monkeypatch, engine.carry, "abandon")
    got = scores(engine)
    monkeypatch.undo()
    done = drain(engine)
    assert list(done) == [stream]
    assert view([done[stream]]) == view(make("plain", True).generate(PROMPTS[1:2], PARAMS[1]))
    assert_clean(engine)
    want = scores(make("plain", True))
    assert [ids for _, ids in got] == [ids for _, ids in want]
    for (a, _), (b, _) in zip(got, want):
        assert a == pytest.approx(b, abs=1e-5)
