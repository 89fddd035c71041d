"""KV holds of outputs that are never returned go with them: abort() of a finished unreturned
request, abort() of a running one (its finished samples' holds), abort_all(); release_hold
reads its key as resume= does; admission releases holds only when that makes the room it
needs (a turn not admitted keeps the hold it resumes). Checked against the pool's counts and
the invariants after every call."""

import pytest
import torch
from models import tiny_model

from rollout import Engine, EngineConfig, SamplingParams

CONFIG = dict(kv_cache_tokens=256, max_model_len=64)


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen2")


def locked(engine) -> int:
    view = engine.inspect()
    return view.kv_slots - view.kv_available


def finished_unreturned(model):
    """An engine whose hold_kv request "ep" (n = 2) finished while generate() stepped: its
    output waits for step(), its two samples' K/V held."""
    engine = Engine(model, EngineConfig(**CONFIG))
    engine.add_request([3, 4, 5], SamplingParams(n=2, temperature=0, max_tokens=4),
                       request_id="ep", hold_kv=True)
    engine.generate([[7, 8]], SamplingParams(temperature=0, max_tokens=10))
    assert engine.has_unfinished and set(engine.inspect().holds) == {("ep", 0), ("ep", 1)}
    return engine


@pytest.mark.parametrize("how", ["abort", "abort_all"])
def test_dropping_a_finished_output_drops_its_holds(model, how):
    engine = finished_unreturned(model)
    engine.abort("ep") if how == "abort" else engine.abort_all()
    engine.check_invariants()
    assert not engine.has_unfinished and engine.inspect().holds == ()
    assert locked(engine) == 0


def test_aborting_a_running_request_drops_its_finished_samples_holds(model):
    """Samples of one request end at different steps (one at EOS, say): sample 0 is made to
    end after 2 tokens (its own params), sample 1 runs on when the request is aborted."""
    engine = Engine(model, EngineConfig(**CONFIG))
    params = SamplingParams(n=2, temperature=0, max_tokens=30, ignore_eos=True)
    engine.add_request([3, 4, 5], params, request_id="ep", hold_kv=True)
    seqs = engine.requests.running["ep"].seqs
    seqs[0].params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    while not seqs[0].is_finished:
        engine.step()
    assert not seqs[1].is_finished and ("ep", 0) in engine.inspect().holds
    engine.abort("ep")
    engine.check_invariants()
    assert engine.inspect().holds == () and locked(engine) == 0


def test_release_hold_reads_its_key_as_resume_does(model):
    engine = finished_unreturned(model)
    assert engine.release_hold(["ep", torch.tensor(0)])  # a list, a tensor index
    assert engine.inspect().holds == (("ep", 1),)
    for bad in ("ep", ("ep",), (0, 1), ("ep", -1), ("ep", 1.5)):
        with pytest.raises(ValueError, match="key"):
            engine.release_hold(bad)
    assert engine.inspect().holds == (("ep", 1),)  # nothing changed
    engine.check_invariants()


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
@pytest.mark.parametrize("how", ["abort", "abort_all"])
def test_a_failure_while_dropping_holds_changes_nothing(model, how, error, monkeypatch):
    engine = finished_unreturned(model)
    real, calls = engine.kv.unhold, [0]

    def failing(key):
        calls[0] += 1
        if calls[0] == 2:  # the second sample's hold, the first already released
            raise error("injected")
        return real(key)

    monkeypatch.setattr(engine.kv, "unhold", failing)
    with pytest.raises(error):
        engine.abort("ep") if how == "abort" else engine.abort_all()
    monkeypatch.undo()
    engine.check_invariants()
    assert engine.has_unfinished and set(engine.inspect().holds) == {("ep", 0), ("ep", 1)}
    outs = engine.step()  # the output is still there to return
    assert [o.request_id for o in outs] == ["ep"]


def held_turn_and_runner(model):
    """A 64-slot pool: an episode's first turn held (19 slots), then a running request R."""
    engine = Engine(model, EngineConfig(kv_cache_tokens=64, max_model_len=64))
    engine.add_request(list(range(1, 16)), SamplingParams(temperature=0, max_tokens=5,
                                                          ignore_eos=True),
                       request_id="ep", hold_kv=True)
    while engine.has_unfinished:
        engine.step()
    engine.add_request(list(range(20, 50)), SamplingParams(temperature=0, max_tokens=8,
                                                           ignore_eos=True), request_id="R")
    engine.step()
    assert engine.inspect().holds == (("ep", 0),)
    return engine


def step_with(engine, ids: list[int], **kwargs):
    """One step after request W (`ids`, 2 greedy tokens) arrives; the engine's view then."""
    engine.add_request(ids, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),
                       request_id="W", **kwargs)
    engine.step()
    engine.check_invariants()
    return engine.inspect()


def test_admission_keeps_holds_that_could_not_make_room(model):
    """W (40 tokens) cannot fit beside R even with the hold released: the hold stays, W waits,
    and is admitted once R is done."""
    engine = held_turn_and_runner(model)
    view = step_with(engine, list(range(50, 90)))
    assert view.waiting == 1 and view.holds == (("ep", 0),)
    assert engine.stats.holds_dropped == 0
    done = {}
    while engine.has_unfinished:
        done.update((o.request_id, o) for o in engine.step())
    assert set(done) == {"R", "W"}  # W ran once R freed its slots (the hold dropped then)
    engine.check_invariants()


def test_admission_drops_holds_that_make_room(model):
    """W (24 tokens) fits once the hold is released: it is, oldest first, and W runs."""
    engine = held_turn_and_runner(model)
    view = step_with(engine, list(range(50, 74)))
    assert view.waiting == 0 and view.holds == () and engine.stats.holds_dropped == 1


def test_a_turn_not_admitted_keeps_the_hold_it_resumes(model):
    """The next turn (its prompt the first turn's and 30 tokens more) cannot fit beside R:
    the hold it resumes stays until it is admitted."""
    engine = held_turn_and_runner(model)
    view = step_with(engine, list(range(1, 16)) + list(range(60, 90)), resume=("ep", 0))
    assert view.waiting == 1 and view.holds == (("ep", 0),)
    while engine.has_unfinished:
        engine.step()
    assert engine.inspect().holds == ()  # released once the turn was admitted
    engine.check_invariants()


def test_a_failed_admission_keeps_the_holds_in_their_order(model):
    """Holds are dropped oldest first: an admission that could not make room (its releases
    undone) leaves them in the order they were taken, so the oldest still goes first."""
    engine = Engine(model, EngineConfig(kv_cache_tokens=96, max_model_len=64))
    for name in "ABC":
        engine.add_request([ord(name), 2, 3, 4, 5], SamplingParams(temperature=0, max_tokens=2,
                                                                    ignore_eos=True),
                           request_id=name, hold_kv=True)
        while engine.has_unfinished:
            engine.step()
    engine.add_request(list(range(20, 60)), SamplingParams(temperature=0, max_tokens=20,
                                                           ignore_eos=True), request_id="R")
    engine.step()
    held = [key[0] for key in engine.inspect().holds]
    assert held == ["A", "B", "C"]
    view = step_with(engine, list(range(60, 120)))  # 60 tokens: no room even without holds
    assert [key[0] for key in view.holds] == held and view.waiting == 1
    engine.abort("W")
    view = step_with(engine, list(range(60, 98)))  # 38 tokens: some holds must go
    left = [key[0] for key in view.holds]
    assert view.waiting == 0 and len(left) < 3 and left == held[3 - len(left):]


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_a_failure_after_admission_dropped_holds_restores_them_in_order(model, error,
                                                                        monkeypatch):
    """The step's unit rolls back the holds an admission released (and the turn's own, which
    it resumes): all of them back, in the order they were taken, and the step runs again."""
    engine = held_turn_and_runner(model)
    engine.add_request(list(range(1, 16)) + [70, 71], SamplingParams(temperature=0, max_tokens=2,
                                                                     ignore_eos=True),
                       request_id="turn2", resume=("ep", 0))
    before = engine.inspect()
    real = engine.kv.make_room

    def failing(n, release=None):
        made = real(n, release)  # the releases done, then the admission fails
        assert made and engine.inspect().holds == ()
        raise error("injected")

    monkeypatch.setattr(engine.kv, "make_room", failing)
    with pytest.raises(error):
        engine.step()
    monkeypatch.undo()
    engine.check_invariants()
    after = engine.inspect()
    assert after.holds == before.holds and after.waiting == before.waiting
    assert engine.stats.holds_dropped == 0
    while engine.has_unfinished:
        engine.step()
    assert engine.inspect().holds == ()
    engine.check_invariants()
