"""Faults (RuntimeError, KeyboardInterrupt) at the points drafting from history adds: a
finished request's samples remembered (inside the unit that ends it), their flush into the
history, the proposal, the history's lookup and continuation, the running acceptance rates, the
measured step cost.
Afterwards the engine is clean, and the same generate() returns what a fresh engine returns
(the history drafts again)."""

from __future__ import annotations

import sys

import pytest
from test_faults import PARAMS, PROMPTS, Fault, assert_clean, assert_exact, make

from rollout.spec.history import DraftHistory

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



class FaultInside(Fault):
    """Raises `kind` inside the `at`-th run of `code` itself: as it starts, or as it returns
    (then its locals, all it had in hand, go with the exception's traceback)."""

    def __init__(self, kind: type[BaseException], at: int, after: bool, code) -> None:
        super().__init__(kind, at, after)
        self.code = code

    def __call__(self, frame, event, arg):  # sys.settrace's, on every call
        if event != "call" or frame.f_code is not self.code:
            return None
        self.calls += 1
        if self.calls != self.at:
            return None
        if not self.after:
            raise self.kind("injected fault")

        def on_return(frame, event, arg):
            if event == "return":
                raise self.kind("injected fault")
            return on_return
        return on_return


@pytest.mark.parametrize("after", [False, True], ids=["before", "after"])
@pytest.mark.parametrize("kind", [RuntimeError, KeyboardInterrupt], ids=["error", "interrupt"])
@pytest.mark.parametrize("point", ["matches", "_live_offsets", "_live"])
def test_a_kept_lookup_fault_does_not_stop_the_history_growing(point, kind, after):
    """A fault inside the history's lookup (the 3rd run of each point: inside a lookup of the
    step after a flush), and the caller keeps the exception (a retry loop's `last = e`,
    pytest.raises, Jupyter's sys.last_traceback) and with it the frames it went through: the
    history still takes new samples and stays whole, and the engine returns what it returns
    without speculation. (The views that pinned the index arrays escaped from _live_offsets
    and _live, after they return: those cases failed before; the others guard the rest of
    the lookup.)"""
    engine = make("suffix", True)
    engine.generate(PROMPTS, PARAMS)
    fn = getattr(DraftHistory, point)
    code = (fn.fget if point == "_live" else fn).__code__  # (_live: a property)
    fault = FaultInside(kind, at=3, after=after, code=code)
    tracer = sys.gettrace()  # (a coverage run's or a debugger's: given back after)
    sys.settrace(fault)
    try:
        with pytest.raises(kind, match="injected") as kept:
            engine.generate(PROMPTS, PARAMS)
    finally:
        sys.settrace(tracer)
    assert fault.fired
    assert_clean(engine)
    assert_exact(engine, "plain", True)  # what speculation off returns
    assert engine.stats.spec_sources.get("history", [0, 0])[0] > 0
    assert_clean(engine)
    assert kept.value is not None  # held to the end
