"""Faults (RuntimeError, KeyboardInterrupt) at the points drafting from history adds: a
finished request's samples remembered (inside the unit that ends it), their flush into the
history, the proposal, the history's lookup and continuation, the running acceptance rates, the
measured step cost.
Afterwards the engine is clean, and the same generate() returns what a fresh engine returns
(the history drafts again)."""

from __future__ import annotations

import pytest
from test_faults import PARAMS, PROMPTS, Fault, assert_clean, assert_exact, make

POINTS = {
    "remember": lambda e: (e.speculator.drafter, "remember"),
    "flush": lambda e: (e.speculator.drafter, "flush"),
    "history_add": lambda e: (e.speculator.drafter.history, "add"),
    "propose": lambda e: (e.speculator.drafter, "propose_batch"),
    "matches": lambda e: (e.speculator.drafter.history, "matches"),
    "continuation": lambda e: (e.speculator.drafter.history, "continuation"),
    "learn": lambda e: (e.speculator, "_learn"),  # the adaptive rates, inside the commit
    # the measured step cost, after a step's commit (spec/cost.py)
    "observe_step": lambda e: (e.speculator, "observe_step"),
    "cost": lambda e: (e.speculator.cost, "observe"),
}


@pytest.mark.parametrize("after", [False, True], ids=["before", "after"])
@pytest.mark.parametrize("kind", [RuntimeError, KeyboardInterrupt], ids=["error", "interrupt"])
@pytest.mark.parametrize("point", list(POINTS))
def test_fault_while_drafting_from_history_leaves_the_engine_exact(point, kind, after,
                                                                 monkeypatch):
    engine = make("suffix", True)
    engine.generate(PROMPTS, PARAMS)  # a history to draft from
    fault = Fault(kind, at=2, after=after)
    fault.install(monkeypatch, *POINTS[point](engine))
    with pytest.raises(kind, match="injected"):
        engine.generate(PROMPTS, PARAMS)
    assert fault.fired
    monkeypatch.undo()
    assert_clean(engine)
    assert_exact(engine, "suffix", True)
    assert engine.stats.spec_sources.get("history", [0, 0])[0] > 0
    assert_clean(engine)
