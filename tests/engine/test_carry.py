"""Partial rollouts (rollout/engine/carry.py): groups carried across rollout() calls, sleep and
update_weights resume as an uninterrupted run would go on; versions, staleness, over-sampling,
bad input and faults at every new point.

The engines are test_faults.py's: a 64-slot pool, chunked prefills and preemption, with and
without speculation and prefix caching. Logprobs are held to a float64 copy of the model: a
carried sample may be as far from the float64 answer as the uninterrupted run is (the re-prefilled
K/V and other batches round differently in the last bits), twice over (tests/support/floors.py).
"""

from __future__ import annotations

import functools

import pytest
import torch
from floors import exact_copy, token_logprobs, tolerance
from models import tiny_model
from test_faults import SPECS, TOK, Fault, make, target

from rollout import SamplingParams
from rollout.requests.sequence import Sequence

PROMPTS = ["ab 1+2=", "the cat sat on", "ab 1+2=3 and 4", "zz top", "a b c d e f"]
# Lengths from 3 to 21 tokens: the first rollout(groups=1) returns the shortest and carries the
# others mid-way. Seeded sampling (some truncated by top-p) and greedy, n = 2.
PARAMS = [SamplingParams(n=2, temperature=1.0, seed=i, max_tokens=3 + 6 * i, logprobs=True,
                         top_p=0.9 if i % 2 else 1.0) for i in range(4)] + \
         [SamplingParams(n=2, temperature=0, max_tokens=14, logprobs=True)]


@functools.cache
def other_weights():
    """The weights a trainer's update brings: target()'s architecture, other values."""
    return tiny_model("qwen2", seed=7, vocab_size=len(TOK))


@functools.cache
def exact(which: str):
    return exact_copy({"target": target(), "other": other_weights()}[which])


@functools.cache
def uninterrupted(spec: str, caching: bool):
    return by_prompt(make(spec, caching).generate(PROMPTS, PARAMS))


def by_prompt(outs) -> dict[str, list]:
    return {TOK.decode(o.prompt_token_ids): o.samples for o in outs}


def tokens(outs: dict[str, list]) -> dict[str, list]:
    return {p: [s.token_ids for s in samples] for p, samples in outs.items()}


def exact_gap(outs: dict[str, list], which: str = "target") -> float:
    """The largest gap of the outputs' logprobs to the float64 model's on the same tokens."""
    gaps = [(torch.tensor(s.logprobs, dtype=torch.float64)
             - token_logprobs(exact(which), TOK.encode(p), s.token_ids)).abs().max().item()
            for p, samples in outs.items() for s in samples]
    return max(gaps)


def lp_gap(a: dict[str, list], b: dict[str, list]) -> float:
    return max(abs(x - y) for p in a for sa, sb in zip(a[p], b[p])
               for x, y in zip(sa.logprobs, sb.logprobs))


def all_logprobs(outs: dict[str, list]) -> torch.Tensor:
    return torch.tensor([x for samples in outs.values() for s in samples for x in s.logprobs])


def carried_run(engine, cycles: int, weights=None) -> dict[str, list]:
    """rollout(groups=1) calls with `cycles` sleep/wake cycles between them (odd ones at level
    2, refilled by update_weights with `weights`, target()'s by default), then one call that
    takes every carried group. The last prompts join in the second call."""
    outs = engine.rollout(PROMPTS[:3], PARAMS[:3], groups=1)
    for c in range(cycles):
        level = 1 + c % 2
        engine.sleep(level)
        engine.check_invariants()
        engine.wake_up()
        if level == 2:
            engine.update_weights(weights or target())
        engine.check_invariants()
        new = (PROMPTS[3:], PARAMS[3:]) if c == 0 else ([], None)
        outs += engine.rollout(*new, groups=min(1, len(engine.carried) + len(new[0])))
        engine.check_invariants()
    outs += engine.rollout()
    assert not engine.carried and not engine.has_unfinished
    return by_prompt(outs)


RESUME_CASES = [("plain", True, 1), ("plain", True, 2), ("plain", True, 5), ("plain", False, 2),
                ("ngram", True, 2), ("ngram", False, 5), ("draft", True, 2), ("draft", False, 5)]


@pytest.mark.parametrize("spec,caching,cycles", RESUME_CASES)
def test_carried_groups_resume_as_the_uninterrupted_run(spec, caching, cycles):
    """Through 1, 2 or 5 sleep/wake cycles (level 1, and level 2 refilled with the same
    weights): every sample's tokens are the uninterrupted run's, its logprobs as close."""
    engine = make(spec, caching)
    got = carried_run(engine, cycles)
    want = uninterrupted(spec, caching)
    assert engine.stats.retracted > 0, "nothing was running at a sleep: nothing was carried"
    assert tokens(got) == tokens(want)
    bound = tolerance(exact_gap(want), all_logprobs(want))
    assert lp_gap(got, want) <= bound
    versions = 1 + sum(1 for c in range(cycles) if c % 2)  # level-2 cycles update the weights
    assert engine.weights_version == versions - 1
    for samples in got.values():
        for s in samples:
            assert len(s.weights_versions) == len(s.token_ids)
            assert s.weights_versions == sorted(s.weights_versions)


@pytest.mark.parametrize("spec,cycles,dtype", [("plain", 5, torch.float32),
                                               ("draft", 2, torch.float32),
                                               ("plain", 2, torch.bfloat16),
                                               ("ngram", 5, torch.bfloat16)])
def test_batch_invariant_resume_is_bit_for_bit(spec, cycles, dtype):
    """EngineConfig(batch_invariant=True): re-prefilled K/V are the decoded K/V's bits, so a
    carried group's logprobs too are exactly the uninterrupted run's, in bf16 as well."""
    model = tiny_model("qwen2", vocab_size=len(TOK), dtype=dtype)

    def record(outs):
        return {p: [(s.token_ids, s.logprobs, s.sampling_logprobs) for s in samples]
                for p, samples in outs.items()}

    want = by_prompt(make(spec, True, model, batch_invariant=True).generate(PROMPTS, PARAMS))
    engine = make(spec, True, model, batch_invariant=True)
    got = carried_run(engine, cycles, weights=model)
    assert engine.stats.retracted > 0
    assert record(got) == record(want)


def test_tokens_after_an_update_are_the_new_weights_on_the_same_context():
    """A group carried across a real update: tokens before it are stamped 0, after it 1; those
    after are what a fresh engine on the new weights draws from the same context (sample j of
    a request with the same seed), with logprobs of a transformers forward of the new weights."""
    engine = make("plain", True)
    first = by_prompt(engine.rollout(PROMPTS[:3], PARAMS[:3], groups=1))
    engine.sleep(2)
    engine.wake_up()
    engine.update_weights(other_weights())
    rest = by_prompt(engine.rollout())
    assert set(first) | set(rest) == set(PROMPTS[:3])
    fresh = make("plain", True, other_weights())
    crossed = 0
    for prompt, samples in rest.items():
        params = PARAMS[PROMPTS.index(prompt)]
        for j, s in enumerate(samples):
            cut = s.weights_versions.index(1) if 1 in s.weights_versions else len(s.token_ids)
            assert s.weights_versions == [0] * cut + [1] * (len(s.token_ids) - cut)
            if cut == len(s.token_ids):
                continue  # finished before the update
            crossed += 1
            context = TOK.encode(prompt) + s.token_ids[:cut]
            again = fresh.generate([context], SamplingParams(
                n=j + 1, temperature=params.temperature, top_p=params.top_p, seed=params.seed,
                max_tokens=params.max_tokens - cut, logprobs=True))[0].samples[j]
            assert s.token_ids[cut:] == again.token_ids
            after = torch.tensor(s.logprobs[cut:], dtype=torch.float64)
            want = token_logprobs(exact("other"), context, s.token_ids[cut:])
            f32 = token_logprobs(other_weights(), context, s.token_ids[cut:])
            assert (after - want).abs().max().item() <= tolerance(
                (f32 - want).abs().max().item(), want)
    assert crossed >= 2


@pytest.mark.parametrize("policy", ["restart", "drop", "keep"])
def test_staleness_policies(policy):
    """max_staleness=0: after an update, a group with older tokens restarts from its prompt
    (then it is the new weights' sample of the same request), is dropped, or is kept."""
    engine = make("plain", True, max_staleness=0, stale_groups=policy)
    returned = by_prompt(engine.rollout(PROMPTS[:3], PARAMS[:3], groups=1))
    carried = list(engine.carried)
    assert len(carried) == 2
    engine.update_weights(other_weights())  # awake: the running groups are retracted
    engine.check_invariants()
    stats = engine.stats
    assert (stats.stale_restarts, stats.stale_drops) == {
        "restart": (2, 0), "drop": (0, 2), "keep": (0, 0)}[policy]
    assert engine.carried == ([] if policy == "drop" else carried)
    rest = by_prompt(engine.rollout())
    engine.check_invariants()
    if policy == "drop":
        assert rest == {}
        return
    new = by_prompt(make("plain", True, other_weights()).generate(PROMPTS[:3], PARAMS[:3]))
    for prompt, samples in rest.items():
        for s, fresh in zip(samples, new[prompt]):
            if policy == "restart":
                assert s.token_ids == fresh.token_ids
                assert set(s.weights_versions) == {1}
            else:
                assert s.weights_versions[0] == 0
    assert set(returned) | set(rest) == set(PROMPTS[:3])


@pytest.mark.parametrize("kind", [None, RuntimeError, KeyboardInterrupt],
                         ids=["", "error", "interrupt"])
@pytest.mark.parametrize("policy", ["restart", "drop"])
def test_staleness_covers_streaming_requests_not_yet_stepped_out(policy, kind, monkeypatch):
    """A streaming request (add_request) that completed during rollout()'s steps waits for
    step(); after an update with max_staleness=0 it is handled as a running one: restarted
    (step() returns the new weights' draw of it, as a fresh engine's) or dropped (step()
    returns nothing of it). It had come out with its old-weights tokens under both. A fault
    restarting or dropping it leaves it waiting for step() as it was, and the next step()
    handles it (a caller who only streams calls no rollout())."""
    engine = make("plain", True, max_staleness=0, stale_groups=policy)
    rid = engine.add_request(PROMPTS[0], PARAMS[0])  # 3 tokens
    engine.rollout(PROMPTS[4:], PARAMS[4:], groups=1)  # 14: the streaming one completes
    assert rid not in engine.running_requests and engine.has_unfinished
    if kind is None:
        engine.update_weights(other_weights())
    else:
        fault = Fault(kind, at=1, after=False)
        fault.install(monkeypatch, *((Sequence, "restart") if policy == "restart"
                                     else (engine.requests, "take_ready")))
        with pytest.raises(kind):
            engine.update_weights(other_weights())
        monkeypatch.undo()
        assert fault.fired and engine.weights_version == 1
        assert list(engine.requests.ready) == [rid] and not engine.running_requests
        engine.check_invariants()
    outs = []
    while engine.has_unfinished:
        outs += engine.step()
    engine.check_invariants()
    stats = engine.stats
    assert (stats.stale_restarts, stats.stale_drops) == {"restart": (1, 0), "drop": (0, 1)}[policy]
    if policy == "drop":
        assert outs == []
        return
    (out,) = outs
    fresh = make("plain", True, other_weights()).generate([PROMPTS[0]], PARAMS[0])[0]
    assert [s.token_ids for s in out.samples] == [s.token_ids for s in fresh.samples]
    assert {v for s in out.samples for v in s.weights_versions} == {1}


def test_a_restarted_group_drafts_from_its_new_tokens():
    """A group restarted at an update starts again from its prompt while the draft model's
    shadow of it still held its old tokens in the draft's tree (which rollback cannot undo):
    the shadow is made again, and the group finishes as a fresh engine's (the restarted sample
    decodes from its first step, its prompt cached by a sibling: it once crashed on an empty
    draft batch)."""
    engine = make("draft", True, max_staleness=0)
    params = SamplingParams(n=2, temperature=0, max_tokens=8)
    engine.generate([PROMPTS[4]], params)  # the draft's tree holds the prompt
    engine.update_weights(target())
    rid = engine.add_request(PROMPTS[4], params)
    for _ in range(3):
        engine.step()
    engine.update_weights(target())
    assert engine.stats.stale_restarts == 1
    engine.check_invariants()
    done = {}
    while engine.has_unfinished:
        done.update({o.request_id: o for o in engine.step()})
        engine.check_invariants()
    fresh = make("plain", True).generate([PROMPTS[4]], params)[0]
    assert [s.token_ids for s in done[rid].samples] == [s.token_ids for s in fresh.samples]


def test_an_update_releases_kv_holds():
    """A multi-turn episode's held K/V came from the old weights: after update_weights the
    next turn, resuming on its hold, draws what a fresh engine on the new weights draws from
    the same context, bit for bit (the batch-invariant mode)."""
    params = SamplingParams(n=1, temperature=1.0, seed=3, max_tokens=6, logprobs=True)
    engine = make("plain", True, batch_invariant=True)
    first = engine.add_request(PROMPTS[1], params, hold_kv=True)
    done = {}
    while engine.has_unfinished:
        done.update({o.request_id: o for o in engine.step()})
    context = done[first].prompt_token_ids + done[first].samples[0].token_ids + TOK.encode(" ok")
    engine.update_weights(other_weights())
    assert engine.inspect().kv_available == engine.inspect().kv_slots  # nothing held
    second = engine.add_request(context, params, resume=(first, 0))
    while engine.has_unfinished:
        done.update({o.request_id: o for o in engine.step()})
    fresh = make("plain", True, other_weights(), batch_invariant=True)
    want = fresh.generate([context], params)[0].samples[0]
    got = done[second].samples[0]
    assert (got.token_ids, got.logprobs) == (want.token_ids, want.logprobs)


def test_staleness_counts_versions():
    """max_staleness=1: a group is stale only once its oldest token is two versions old; a
    group still waiting (no token yet) never is."""
    engine = make("plain", True, max_staleness=1)
    engine.rollout(PROMPTS[:3], PARAMS[:3], groups=1)
    engine.rollout(PROMPTS[3:], PARAMS[3:], groups=0)  # queued, not yet admitted
    engine.update_weights(target())
    assert engine.stats.stale_restarts == 0
    engine.update_weights(target())
    assert engine.stats.stale_restarts == 2
    for samples in by_prompt(engine.rollout()).values():
        for s in samples:
            assert set(s.weights_versions) == {2}


@pytest.mark.parametrize("kind", [RuntimeError, KeyboardInterrupt], ids=["error", "interrupt"])
def test_an_update_failing_after_its_copy_still_bounds_staleness(kind, monkeypatch):
    """Packing the new weights (after the copy and the version's bump) fails, out of memory
    say: the weights are in, so the update counts and max_staleness=0 restarts the carried
    groups: none comes out with an older token."""
    engine = make("plain", True, max_staleness=0)
    engine.rollout(PROMPTS[:3], PARAMS[:3], groups=1)

    def pack():
        raise kind("packing the new weights")

    monkeypatch.setattr(engine.stack.model, "pack_weights", pack)
    with pytest.raises(kind):
        engine.update_weights(other_weights())
    monkeypatch.undo()
    engine.check_invariants()
    assert (engine.weights_version, engine.stats.weight_syncs) == (1, 1)
    assert engine.stats.stale_restarts == 2
    rest = by_prompt(engine.rollout())
    assert len(rest) == 2 and all(set(s.weights_versions) == {1}
                                  for samples in rest.values() for s in samples)


@pytest.mark.parametrize("kind", [RuntimeError, KeyboardInterrupt], ids=["error", "interrupt"])
def test_a_draft_sleep_failing_before_its_pool_goes_leaves_it_whole(kind, monkeypatch):
    """The draft model's stack fails to sleep (its pool's release) with groups carried: the
    engine stays awake, the draft's shadows and K/V agree, and the groups go on as the
    uninterrupted run (its slots all accounted for at the end)."""
    engine = make("draft", True)
    engine.rollout(PROMPTS[:3], PARAMS[:3], groups=1)
    drafter = engine.speculator.drafter
    assert drafter.shadows

    def release():
        raise kind("the draft pool's release")

    monkeypatch.setattr(drafter.stack.pool, "release", release)
    with pytest.raises(kind):
        engine.sleep(1)
    monkeypatch.undo()
    assert not engine.is_sleeping
    engine.check_invariants()
    rest = by_prompt(engine.rollout())
    want = tokens(uninterrupted("draft", True))
    assert len(rest) == 2 and tokens(rest) == {p: want[p] for p in rest}
    engine.check_invariants()


def test_an_output_carries_the_version_it_completed_under():
    """A group complete but not handed out, and a streaming request finished inside a
    generate(), both before an update: each output's weights_version is its newest token's
    (the engine's version when it completed), not the version when it is handed out."""
    engine = make("plain", True)
    short = [PARAMS[0]] * 2  # 3 tokens: both complete in the first call
    rid = engine.add_request(PROMPTS[4], PARAMS[0])
    engine.rollout(PROMPTS[:2], short, groups=1)
    engine.generate([PROMPTS[3]], PARAMS[3])  # 21 tokens: the others complete meanwhile
    assert len(engine.carried) == 1 and not engine.requests.running
    engine.update_weights(target())
    outs = [*engine.rollout(), *engine.step()]
    assert {o.request_id for o in outs} >= {rid} and len(outs) == 2
    for o in outs:
        assert o.weights_version == 0 == max(v for s in o.samples for v in s.weights_versions)


def test_a_group_with_no_token_carries_the_version_it_ended_under():
    """Groups the engine aborted at their first step (non-finite logits) have no token to
    date them: a carried one still reports the version it ended under after an update."""
    good = tiny_model("llama", seed=7, vocab_size=len(TOK))  # (an untied head)
    broken = tiny_model("llama", seed=7, vocab_size=len(TOK))
    with torch.no_grad():
        broken.lm_head.weight.fill_(3e38)  # finite weights, infinite logits
    engine = make("plain", True, good)
    engine.update_weights(broken)
    # (two short prompts: both admitted, and aborted, in the first step)
    first = engine.rollout([PROMPTS[0], PROMPTS[3]], [PARAMS[0], PARAMS[3]], groups=1)
    assert first[0].error is not None and len(engine.carried) == 1
    engine.update_weights(good)
    (later,) = engine.rollout()
    assert later.error is not None and not any(s.token_ids for s in later.samples)
    assert (first[0].weights_version, later.weights_version) == (1, 1)


def test_over_sampling_returns_the_oldest_complete_groups_and_carries_the_rest():
    engine = make("plain", True)
    outs = engine.rollout(PROMPTS, PARAMS, groups=2)
    assert len(outs) == 2 and len(engine.carried) == 3
    ids = {o.request_id for o in outs}
    assert not ids & set(engine.carried)
    # step() hands out streaming requests only; the carried groups wait for rollout().
    while engine.has_unfinished:
        assert engine.step() == []
    assert len(engine.carried) == 3  # complete now, still carried
    oldest = engine.carried[:2]
    later = engine.rollout(groups=2)
    assert [o.request_id for o in later] == oldest
    assert len(engine.carried) == 1
    engine.check_invariants()


def test_abort_rest_aborts_every_other_group():
    engine = make("plain", True)
    outs = engine.rollout(PROMPTS, PARAMS, groups=2, abort_rest=True)
    assert len(outs) == 2 and engine.carried == [] and not engine.has_unfinished
    engine.check_invariants()
    assert engine.inspect().kv_available == engine.inspect().kv_slots  # aborted K/V is cached
    assert tokens(by_prompt(engine.generate(PROMPTS, PARAMS))) == tokens(
        uninterrupted("plain", True))


def test_a_carried_group_can_be_aborted_running_or_complete():
    engine = make("plain", True)
    engine.rollout(PROMPTS, PARAMS, groups=1)
    running = engine.carried[-1]
    engine.abort(running)
    assert running not in engine.carried
    while engine.has_unfinished:
        engine.step()
    complete = engine.carried[0]
    engine.abort(complete)
    outs = engine.rollout()
    assert {o.request_id for o in outs}.isdisjoint({running, complete})
    assert len(outs) == 2
    engine.check_invariants()


def test_groups_carry_the_ids_they_were_asked_with():
    """rollout(request_ids=): each group's output comes back under its own id, calls later
    (a caller pairs it with what it asked for); ids in use, repeated or miscounted are
    refused before anything is queued."""
    engine = make("plain", True)
    first = engine.rollout(PROMPTS[:3], PARAMS[:3], groups=1, request_ids=["a", "b", "c"])
    assert [o.request_id for o in first] == ["a"] and engine.carried == ["b", "c"]
    for ids, refusal in ((["b", "x"], "request_ids: 'b' is already running"),
                         (["x", "x"], "request_ids: an id is given twice"),
                         (["x"], "request_ids: 1 ids for 2 prompts"),
                         ("xy", "request_ids must be a list")):
        with pytest.raises(ValueError, match=refusal):
            engine.rollout(PROMPTS[3:], PARAMS[3:], groups=0, request_ids=ids)
    assert engine.carried == ["b", "c"]
    # None: an id drawn for that prompt, as with request_ids=None (it had been the id "None")
    rest = engine.rollout(PROMPTS[3:], PARAMS[3:], request_ids=["d", None])
    drawn = {o.request_id for o in rest} - set("bcd")
    assert len(rest) == 4 and len(drawn) == 1 and drawn != {"None"}
    by_id = {o.request_id: TOK.decode(o.prompt_token_ids) for o in first + rest}
    assert by_id == dict(zip(["a", "b", "c", "d", *drawn], PROMPTS))
    engine.check_invariants()
    # an id drawn for one prompt is never the one the call gives a later prompt (the later
    # request had overwritten the earlier, its group lost)
    fresh = make("plain", True)
    outs = fresh.rollout(PROMPTS[:2], PARAMS[:2], request_ids=[None, "0"])
    assert len({o.request_id for o in outs}) == 2 and "0" in {o.request_id for o in outs}
    fresh.check_invariants()


def test_generate_beside_carried_groups_keeps_both_contracts():
    engine = make("plain", True)
    engine.rollout(PROMPTS[:3], PARAMS[:3], groups=1)
    carried = list(engine.carried)
    outs = engine.generate(PROMPTS[3:], PARAMS[3:])
    assert [TOK.decode(o.prompt_token_ids) for o in outs] == PROMPTS[3:]
    assert engine.carried == carried
    rest = by_prompt(engine.rollout())
    want = tokens(uninterrupted("plain", True))
    assert tokens(rest) == {p: want[p] for p in rest}


def test_empty_and_bad_calls():
    engine = make("plain", True)
    assert engine.rollout() == [] and engine.rollout([], groups=0) == []
    with pytest.raises(ValueError, match=r"groups: 1 asked for, but there are only 0"):
        engine.rollout(groups=1)
    engine.rollout(PROMPTS[:3], PARAMS[:3], groups=1)
    carried = list(engine.carried)
    for bad in (True, -1, 1.5, "2"):
        with pytest.raises(ValueError, match="groups"):
            engine.rollout(PROMPTS[3:], PARAMS[3:], groups=bad)
    with pytest.raises(ValueError, match=r"groups: 5 asked for, but there are only 4 "
                                         r"\(2 carried \+ 2 prompts\)"):
        engine.rollout(PROMPTS[3:], PARAMS[3:], groups=5)
    with pytest.raises(ValueError, match="abort_rest"):
        engine.rollout(groups=1, abort_rest="yes")
    with pytest.raises(ValueError, match="max_tokens"):
        engine.rollout(PROMPTS[3:], SamplingParams(max_tokens=0))
    assert engine.carried == carried  # nothing a refused call did stays
    engine.sleep()
    with pytest.raises(RuntimeError, match="asleep"):
        engine.rollout()
    engine.wake_up()
    assert len(engine.rollout()) == 2
    engine.check_invariants()


# --- faults at every new point ----------------------------------------------------------------
def state(engine):
    """What a failed call must leave as it was: carried groups and their samples' tokens."""
    return [(rid, [s.token_ids for s in engine.requests.running[rid].seqs]
             if rid in engine.requests.running else "complete") for rid in engine.carried]


CARRY_POINTS = {
    "retract": (lambda e: (e.scheduler, "preempt"), lambda e: e.sleep(1)),
    "retract-update": (lambda e: (e.scheduler, "preempt"), lambda e: e.update_weights(target())),
    "restart": (lambda e: (Sequence, "restart"), lambda e: e.update_weights(target())),
    "hand-out": (lambda e: (e.requests, "take_ready"), lambda e: e.rollout(groups=2)),
    "abort-rest": (lambda e: (e.carry, "drop"),
                   lambda e: e.rollout(groups=1, abort_rest=True)),
    "stamp": (lambda e: (e.committer, "weights_version"), lambda e: e.rollout(groups=1)),
    "resume": (lambda e: (e.scheduler, "schedule"), lambda e: e.rollout(groups=1)),
}


@pytest.mark.parametrize("kind", [RuntimeError, KeyboardInterrupt], ids=["error", "interrupt"])
@pytest.mark.parametrize("point", list(CARRY_POINTS))
def test_fault_at_a_carry_point_leaves_the_engine_exact(point, kind, monkeypatch):
    """A fault at the 2nd call of each new point (retracting for sleep or an update, restarting
    stale groups, handing complete groups out, stamping versions, resuming carried groups):
    the call raises, the invariants hold, and carrying on gives the uninterrupted run's
    tokens."""
    engine = make("plain", True, max_staleness=0 if point == "restart" else None)
    engine.rollout(PROMPTS[:3], PARAMS[:3], groups=1)
    engine.rollout(PROMPTS[3:], PARAMS[3:], groups=1)
    if point in ("hand-out", "abort-rest"):  # complete groups to hand out (or drop)
        while engine.has_unfinished:
            engine.step()
    before = state(engine)
    where, call = CARRY_POINTS[point]
    fault = Fault(kind, at=2, after=False)
    fault.install(monkeypatch, *where(engine))
    with pytest.raises(kind):
        call(engine)
    monkeypatch.undo()
    engine.check_invariants()
    if point in ("retract", "retract-update", "restart", "hand-out", "abort-rest"):
        assert state(engine) == before
    assert not engine.is_sleeping
    rest = by_prompt(engine.rollout())
    want = tokens(uninterrupted("plain", True))
    if point == "restart":
        # The update went in, its restarts did not: the next rollout restarts the groups it
        # left stale (their tokens were handed out older than max_staleness=0 allowed), and
        # the restarted groups are the same weights' draws.
        assert engine.stats.stale_restarts > 0
        assert {v for samples in rest.values() for s in samples for v in s.weights_versions} == \
            {engine.weights_version}
    assert tokens(rest) == {p: want[p] for p in rest}
    engine.check_invariants()


@pytest.mark.parametrize("spec", SPECS)
def test_sleep_while_streaming_requests_run_carries_them_too(spec):
    """sleep() no longer refuses while add_request's requests run: they are carried like
    rollout's groups and step() returns them as an uninterrupted run would."""
    engine = make(spec, True)
    ids = [engine.add_request(p, sp) for p, sp in zip(PROMPTS, PARAMS)]
    for _ in range(3):
        engine.step()
    assert engine.running_requests
    engine.sleep(2)
    engine.wake_up()
    engine.update_weights(target())
    done = {}
    while engine.has_unfinished:
        done.update({o.request_id: o for o in engine.step()})
    got = by_prompt([done[i] for i in ids])
    assert tokens(got) == tokens(uninterrupted(spec, True))
    assert engine.stats.retracted > 0
