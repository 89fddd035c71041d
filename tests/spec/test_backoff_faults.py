"""Speculation's per-sample back-off and running acceptance rates under faults: a step that fails
anywhere after the drafts were proposed leaves them as they were, so the engine goes on
proposing exactly the drafts of a twin engine that never ran the failed step."""

from __future__ import annotations

import functools

import pytest
from models import tiny_model
from test_faults import Fault

from rollout import Engine, EngineConfig, SamplingParams
from rollout.spec import SpeculativeConfig

# Repetitive prompts give the n-gram drafter something to find; sampling at temperature 1 from
# a random model rejects most of it, so samples back off.
PROMPTS = [[1, 2, 3, 4, 5] * 3, list(range(10, 30)) * 2, [7, 8, 9] * 4, [4, 4, 4, 4, 4, 4]]
PARAMS = SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=40)

# point -> (what it is, given the engine; a fault after the call rather than before)
POINTS = {
    # the forward, after the drafts were proposed: the back-off counted this step down
    "forward": (lambda e: (e.model, "forward"), False),
    # inside the commit unit: after the back-off and rates were updated...
    "spec_commit": (lambda e: (e.speculator, "after_commit"), True),
    "settle": (lambda e: (e.kv, "settle"), True),
    # ...and after a finished request's state was forgotten
    "retire": (lambda e: (e.requests, "end"), True),
}


@functools.cache
def target():
    return tiny_model("qwen2")


def make() -> Engine:
    engine = Engine(target(), EngineConfig(
        kv_cache_tokens=2048, max_model_len=96, seed=0,
        speculative=SpeculativeConfig("ngram", num_speculative_tokens=3, adaptive=True)))
    # Adaptive lengths weigh the drafts against the measured step cost: the clock, which differs
    # between the twins; unmeasured, both keep the batch-share bar.
    engine.speculator.observe_step = lambda positions, seconds: None
    for prompt in PROMPTS:
        engine.add_request(prompt, PARAMS)
    return engine


def drafting(engine: Engine):
    """What decides the next drafts, and what the drafts so far did."""
    spec, stats = engine.speculator, engine.stats
    return (spec._misses, spec.rates, spec._rates, stats.spec_proposed, stats.spec_accepted,
            stats.spec_sources)


@pytest.mark.parametrize("kind", [RuntimeError, KeyboardInterrupt], ids=["error", "interrupt"])
@pytest.mark.parametrize("point", list(POINTS))
def test_a_failed_step_leaves_the_drafting_state_as_it_was(point, kind, monkeypatch):
    faulty, twin = make(), make()
    where, after = POINTS[point]
    # late enough that samples back off, early enough that requests still run
    fault = Fault(kind, at=1 if point == "retire" else 12, after=after)
    fault.install(monkeypatch, *where(faulty))
    outs, twin_outs, backing_off = {}, {}, False
    while twin.has_unfinished:
        try:
            outs.update({o.request_id: o for o in faulty.step()})
        except kind:
            monkeypatch.undo()
            faulty.check_invariants()
            backing_off = any(not twin.speculator._ready(seq)
                              for r in twin.requests.running.values() for seq in r.seqs)
            assert drafting(faulty) == drafting(twin)
            continue
        twin_outs.update({o.request_id: o for o in twin.step()})
        assert drafting(faulty) == drafting(twin)
    assert fault.fired and not faulty.has_unfinished
    assert point == "retire" or backing_off  # a sample was waiting to propose again
    assert {rid: [s.token_ids for s in o.samples] for rid, o in outs.items()} == \
        {rid: [s.token_ids for s in o.samples] for rid, o in twin_outs.items()}


def test_a_restarted_sample_waits_no_longer_than_the_back_off():
    """A stale group restarted from its prompt (max_staleness 0, stale_groups "restart") starts
    its output again: its back-off, counted against the length it had, must not make it wait
    for its whole old output to grow back (it had waited ~150 steps for a wait of <= 32)."""
    engine = Engine(target(), EngineConfig(
        kv_cache_tokens=4096, max_model_len=400, seed=0, max_staleness=0,
        stale_groups="restart", speculative=SpeculativeConfig("ngram", num_speculative_tokens=3)))
    params = SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=300)
    engine.rollout(PROMPTS[::2], params, groups=0, request_ids=["a", "b"])
    for _ in range(150):
        engine.step()
    spec = engine.speculator
    assert any(not spec._ready(s) or spec._misses.get(s.seq_id, (0,))[0]
               for r in engine.requests.running.values() for s in r.seqs)  # backed off
    engine.update_weights(target())  # the groups restart from their prompts
    seqs = [s for r in engine.requests.running.values() for s in r.seqs]
    assert seqs and all(s.num_output == 0 for s in seqs)
    for _ in range(33):
        if all(spec._ready(s) for s in seqs):
            break
        engine.step()
    assert all(spec._ready(s) for s in seqs)
