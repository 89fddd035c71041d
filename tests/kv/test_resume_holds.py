"""A turn's `resume` releases the previous turn's KV hold once, for the whole request.

Request ids may be used again once their output is returned, so a conversation can keep one
id: the next turn is then `request_id="ep", hold_kv=True, resume=("ep", 0)`, and its samples
hold their K/V under ("ep", 0), ("ep", 1), ... as they finish, the very key they resume. The
reference is what hold_kv promises: every finished sample of the turn is held under (its
request id, its sample index), whatever order its samples are admitted and finish in.
"""

import pytest
from models import tiny_model

from rollout import Engine, EngineConfig, SamplingParams

TURN = [3, 4, 5, 6, 7, 8]


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def first_turn(model, **config) -> tuple[Engine, list[int]]:
    """An engine whose request "ep" finished and was returned, its sample's K/V held under
    ("ep", 0); and the next turn's prompt (the episode so far and an observation)."""
    engine = Engine(model, EngineConfig(kv_cache_tokens=256, max_model_len=64, **config))
    engine.add_request(TURN, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                       request_id="ep", hold_kv=True)
    outs = []
    while engine.has_unfinished:
        outs += engine.step()
    assert engine.inspect().holds == (("ep", 0),)
    return engine, TURN + outs[0].samples[0].token_ids + [50, 51]


@pytest.mark.parametrize("max_num_seqs", [8, 1], ids=["together", "one-at-a-time"])
def test_a_turn_reusing_its_id_holds_every_sample(model, max_num_seqs):
    """n = 2 on one id: side by side (both finish in one step, sample 0 first), or one at a
    time (sample 1 admitted after sample 0 finished and held its K/V)."""
    engine, prompt = first_turn(model, max_num_seqs=max_num_seqs)
    engine.add_request(prompt, SamplingParams(n=2, temperature=1.0, seed=0, max_tokens=4,
                                              ignore_eos=True),
                       request_id="ep", hold_kv=True, resume=("ep", 0))
    while engine.has_unfinished:
        engine.step()
        engine.check_invariants()
    assert set(engine.inspect().holds) == {("ep", 0), ("ep", 1)}
    assert engine.release_hold(("ep", 0)) and engine.release_hold(("ep", 1))
    engine.check_invariants()
    assert engine.inspect().kv_available == engine.inspect().kv_slots



def test_a_failed_admission_leaves_the_resume_as_it_was(model, monkeypatch):
    """A fault after the admission released the hold (at attach): the step is undone, the
    hold is back and every sample still resumes it; the turn then runs as above."""
    engine, prompt = first_turn(model)
    engine.add_request(prompt, SamplingParams(n=2, temperature=1.0, seed=0, max_tokens=4,
                                              ignore_eos=True),
                       request_id="ep", hold_kv=True, resume=("ep", 0))

    def fail(*args):
        raise RuntimeError("injected")

    monkeypatch.setattr(engine.kv, "attach", fail)
    with pytest.raises(RuntimeError, match="injected"):
        engine.step()
    monkeypatch.undo()
    engine.check_invariants()
    assert engine.inspect().holds == (("ep", 0),)
    assert [s.resume_key for s in engine.requests.running["ep"].seqs] == [("ep", 0)] * 2
    while engine.has_unfinished:
        engine.step()
    assert set(engine.inspect().holds) == {("ep", 0), ("ep", 1)}
