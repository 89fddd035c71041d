"""EngineConfig(carried_kv="park"): a sample carried mid-way keeps its K/V across sleep (parked on
the host, written back at wake-up: rollout/kv/parked.py) and across weight updates (kept in the
prefix cache under a tag no fresh request's key carries: KVManager.keep_stale), and goes on from
it. References: the K/V bits before the sleep, the uninterrupted run, a float64 transformers
forward whose cache holds the old weights' K/V of the context and the new weights' K/V after it,
and a fresh engine on the new weights for everything that must not see the stale K/V.
"""

from __future__ import annotations

import functools

import pytest
import torch
from floors import exact_copy, tolerance
from test_carry import (PARAMS, PROMPTS, RESUME_CASES, all_logprobs, by_prompt, carried_run,
                        exact_gap, lp_gap, other_weights, tokens, uninterrupted)
from test_faults import TOK, Fault, make, target

from rollout import Engine, EngineConfig, SamplingParams
from rollout.kv import parked


def roomy(model=None, **overrides) -> Engine:
    """A pool nothing is evicted from: every carried sample's K/V stays whole."""
    return Engine(model or target(), EngineConfig(kv_cache_tokens=1024, max_model_len=40,
                                                 carried_kv="park", **overrides),
                  tokenizer=TOK)


def positions_run(engine: Engine) -> list[dict[int, int]]:
    """Records, for every forward of `engine`, the positions it computes of each sequence."""
    steps: list[dict[int, int]] = []
    prepare = engine.runner.prepare

    def counting(batch):
        steps.append({item.seq.seq_id: item.num_new for item in batch.items})
        return prepare(batch)

    engine.runner.prepare = counting
    return steps


def total(steps: list[dict[int, int]]) -> int:
    return sum(sum(step.values()) for step in steps)


@pytest.mark.parametrize("spec,caching,cycles", [c for c in RESUME_CASES if c[1]])
def test_parked_groups_resume_as_the_uninterrupted_run(spec, caching, cycles):
    """The carried runs of test_carry.py (level-1 sleeps, level-2 sleeps refilled with the same
    weights: parked K/V then continues as stale K/V of an equal model) give the uninterrupted
    run's tokens, logprobs as close, and compute fewer positions than re-prefilling."""
    engine = make(spec, caching, carried_kv="park")
    rows = positions_run(engine)
    got = carried_run(engine, cycles)
    want = uninterrupted(spec, caching)
    assert engine.stats.retracted > 0 and engine.stats.parked_tokens > 0
    assert tokens(got) == tokens(want)
    assert lp_gap(got, want) <= tolerance(exact_gap(want), all_logprobs(want))
    again = make(spec, caching)
    recomputed = positions_run(again)
    carried_run(again, cycles)
    assert total(rows) < total(recomputed)
    assert engine.stats.parked_bytes == 0 and engine.inspect().sleep_level == 0


def running_kv(engine: Engine) -> dict[int, torch.Tensor]:
    """The K/V (every layer) of each running sample with tokens of its own, in token order."""
    kv, pool = engine.kv, engine.pool
    return {s.seq_id: pool.buffer[:, :, kv.table.read(s.row, 0, s.num_computed)].clone()
            for s in engine.scheduler.running if s.versions}


@pytest.mark.parametrize("level", [1, 2])
def test_parked_kv_comes_back_bit_for_bit(level):
    """What wake-up writes back, and the resumed samples' admission matches, is the K/V each
    sample had before the sleep, bit for bit, its whole context; resuming computes one
    position per sample."""
    engine = roomy()
    engine.rollout(PROMPTS[:3], PARAMS[:3], groups=1)
    before = running_kv(engine)
    assert len(before) >= 2
    engine.sleep(level)
    engine.check_invariants()
    assert engine.stats.parked_bytes > 0
    engine.wake_up()
    if level == 2:
        engine.update_weights(target())
    engine.check_invariants()
    waiting = {s.seq_id: s for s in engine.scheduler.waiting}
    for seq_id, kv in before.items():
        seq = waiting[seq_id]
        slots = engine.cache.peek(seq.reusable_tokens())
        assert slots.numel() == kv.shape[2] == seq.num_tokens - 1
        assert torch.equal(engine.pool.buffer[:, :, slots], kv)
    steps = positions_run(engine)
    engine.step()
    assert all(steps[0].get(seq_id) == 1 for seq_id in before)  # the newest token only


@functools.cache
def exact(which: str):
    return exact_copy({"target": target(), "other": other_weights()}[which])


@torch.no_grad()
def stale_rows(old, new, context: list[int], stale: int, tokens: list[int]) -> torch.Tensor:
    """log_softmax of `new`'s logits before each of `tokens` after `context` ([len(tokens),
    vocab]), the K/V of the first `stale` context tokens computed by `old` (float64 when the
    models are)."""
    ids = torch.tensor([context + tokens])
    cache = old(ids[:, :stale], use_cache=True).cache
    logits = new(ids[:, stale:], cache=cache).logits[0]
    return logits[len(context) - 1 - stale:-1].double().log_softmax(-1)


def picked(rows: torch.Tensor, tokens: list[int]) -> torch.Tensor:
    return rows.gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1)


# Seeded samples, and greedy ones for the second prompt.
UPDATE_PARAMS = dict(zip(PROMPTS[:3], [PARAMS[0], PARAMS[4], PARAMS[2]]))


def test_after_an_update_parked_samples_go_on_from_the_old_kv():
    """A real update mid-group: a sample carried mid-way stamps its later tokens 1 and their
    logprobs are a forward of the new weights over its context's old K/V (transformers, float64,
    within twice its own float32 error); greedy ones take that forward's argmax. The same
    logprobs are far from the new weights' own on the same context (what the test tells
    apart). Samples not started at the update are the new weights' fresh draws."""
    engine = roomy()
    engine.rollout(list(UPDATE_PARAMS), list(UPDATE_PARAMS.values()), groups=1)
    engine.sleep(2)
    engine.wake_up()
    engine.update_weights(other_weights())
    assert engine.stats.stale_kv_kept >= 2
    rest = by_prompt(engine.rollout())
    assert engine.stats.preemptions == 0  # nothing of the stale K/V was evicted
    fresh = make("plain", True, other_weights())
    crossed, greedy, apart = 0, 0, 0.0
    for prompt, samples in rest.items():
        params = UPDATE_PARAMS[prompt]
        context = TOK.encode(prompt)
        for j, s in enumerate(samples):
            cut = s.weights_versions.index(1) if 1 in s.weights_versions else len(s.token_ids)
            assert s.weights_versions == [0] * cut + [1] * (len(s.token_ids) - cut)
            if cut == len(s.token_ids):
                continue  # finished before the update
            if cut == 0:  # not started: the new weights' draw
                again = fresh.generate([context], SamplingParams(
                    n=j + 1, temperature=params.temperature, top_p=params.top_p,
                    seed=params.seed, max_tokens=params.max_tokens))[0].samples[j]
                assert s.token_ids == again.token_ids
                continue
            crossed += 1
            before, after = context + s.token_ids[:cut], s.token_ids[cut:]
            stale = len(before) - 1  # the newest token before the update ran after it
            rows = stale_rows(exact("target"), exact("other"), before, stale, after)
            want = picked(rows, after)
            f32 = picked(stale_rows(target(), other_weights(), before, stale, after), after)
            got = torch.tensor(s.logprobs[cut:], dtype=torch.float64)
            bound = tolerance((f32 - want).abs().max().item(), want)
            assert (got - want).abs().max().item() <= bound
            recomputed = picked(stale_rows(exact("other"), exact("other"), before, stale,
                                           after), after)
            apart = max(apart, (got - recomputed).abs().max().item() / bound)
            if params.temperature == 0:  # the argmax, or a tie within float32's error
                greedy += 1
                assert (rows.max(-1).values - want).max().item() <= bound
    assert crossed >= 2 and greedy >= 1
    assert apart > 100, "the old K/V made no difference: the test cannot tell the modes apart"


def test_stale_kv_is_never_shared_with_fresh_requests():
    """After an update, the carried samples' old K/V is cached under their tag only: the same
    prompts asked afresh match none of it and give the new weights' outputs exactly as a fresh
    engine's; the carried groups then finish from their own K/V."""
    engine = roomy()
    engine.rollout(PROMPTS[:3], PARAMS[:3], groups=1)
    engine.update_weights(other_weights())  # awake: retracted, kept under a tag in place
    engine.check_invariants()
    assert engine.stats.stale_kv_kept >= 2 and engine.cache.total_size > 0
    for prompt in PROMPTS[:3]:
        assert engine.cached_prefix_len(TOK.encode(prompt)) == 0
    asked = engine.generate(PROMPTS[:3], PARAMS[:3])
    want = make("plain", True, other_weights()).generate(PROMPTS[:3], PARAMS[:3])
    assert [[s.token_ids for s in o.samples] for o in asked] == \
        [[s.token_ids for s in o.samples] for o in want]
    assert all_logprobs(by_prompt(asked)).tolist() == pytest.approx(
        all_logprobs(by_prompt(want)).tolist(), abs=1e-5)
    assert len(engine.rollout()) == 2
    engine.check_invariants()


def test_a_restarted_group_drops_its_tag():
    """max_staleness=0 restarts a parked group from its prompt: it draws as the new weights do
    afresh (no tag, no stale K/V)."""
    engine = roomy(max_staleness=0)
    engine.rollout(PROMPTS[:3], PARAMS[:3], groups=1)
    engine.update_weights(other_weights())
    assert engine.stats.stale_restarts == 2
    assert all(s.kv_tag is None for s in engine.scheduler.waiting)
    rest = by_prompt(engine.rollout())
    new = by_prompt(make("plain", True, other_weights()).generate(PROMPTS[:3], PARAMS[:3]))
    assert tokens(rest) == {p: tokens(new)[p] for p in rest}


def test_park_needs_prefix_caching_and_a_known_mode():
    with pytest.raises(ValueError, match="carried_kv='park' needs enable_prefix_caching"):
        EngineConfig(carried_kv="park", enable_prefix_caching=False)
    with pytest.raises(ValueError, match="carried_kv"):
        EngineConfig(carried_kv="keep")


# --- faults at the new points -----------------------------------------------------------------
def carried_state(engine):
    return sorted((s.seq_id, tuple(s.token_ids), s.kv_tag, s.kv_bounds)
                  for s in (*engine.scheduler.waiting, *engine.scheduler.running))


@pytest.mark.parametrize("kind", [RuntimeError, KeyboardInterrupt], ids=["error", "interrupt"])
@pytest.mark.parametrize("point", ["park", "unpark-insert", "unpark-alloc", "keep-stale",
                                   "keep-stale-again", "keep-stale-tag", "resume-labelled"])
def test_fault_at_a_park_point_leaves_the_engine_exact(point, kind, monkeypatch):
    """A fault while parking (sleep stays awake), writing parked K/V back (wake-up stays
    asleep, the K/V still parked), keeping stale K/V at an update (its cache cleared, the
    update refused until complete) or re-admitting a tagged sample after it (its new positions
    labelled: Sequence.kv_bounds): invariants hold, the carried samples are as they were, and
    carrying on gives the uninterrupted run's tokens (the update brings equal weights)."""
    engine = make("plain", True, carried_kv="park")
    engine.rollout(PROMPTS[:3], PARAMS[:3], groups=1)
    engine.rollout(PROMPTS[3:], PARAMS[3:], groups=1)
    before = carried_state(engine)
    # keep-stale-tag: before tag_branches (a primitive whose undo is recorded after it).
    fault = Fault(kind, at=2 if point == "unpark-insert" else 1,
                  after=point != "keep-stale-tag")
    if point == "park":
        fault.install(monkeypatch, parked, "park")
        with pytest.raises(kind):
            engine.sleep(1)
        assert not engine.is_sleeping
    elif point == "resume-labelled":
        engine.update_weights(target())
        updated = carried_state(engine)
        assert any(tag is not None for *_, tag, _ in updated)
        fault.install(monkeypatch, engine.kv, "attach")
        with pytest.raises(kind):
            engine.rollout(groups=1)
        assert fault.fired and carried_state(engine) == updated
        monkeypatch.undo()
        engine.check_invariants()
        engine.rollout(groups=1)
        assert any(bounds for *_, bounds in carried_state(engine))
    elif point.startswith("unpark"):
        engine.sleep(1)
        retracted = carried_state(engine)
        fault.install(monkeypatch, engine.kv, "insert" if point == "unpark-insert" else "alloc")
        with pytest.raises(kind):
            engine.wake_up()
        assert engine.is_sleeping and engine.stats.parked_bytes > 0
        assert carried_state(engine) == retracted
        monkeypatch.undo()
        engine.check_invariants()
        engine.wake_up()
    else:
        if point == "keep-stale-again":  # tags an earlier update set, whose K/V the cache
            engine.update_weights(target())  # then loses too
            assert any(tag is not None for *_, tag, _ in carried_state(engine))
        where = ((engine.cache, "tag_branches") if point == "keep-stale-tag"
                 else (engine.kv, "keep_stale"))
        fault.install(monkeypatch, *where)
        with pytest.raises(kind):
            engine.update_weights(target())
        assert fault.fired and engine.needs_weights
        assert all(s.kv_tag is None for s in engine.scheduler.waiting)
        assert engine.cache.total_size == 0  # nothing of the old weights stays cached
        monkeypatch.undo()
        engine.check_invariants()
        engine.update_weights(target())
    monkeypatch.undo()
    engine.check_invariants()
    if point == "park":
        assert carried_state(engine) == before
    rest = by_prompt(engine.rollout())
    want = tokens(uninterrupted("plain", True))
    assert tokens(rest) == {p: want[p] for p in rest}
    engine.check_invariants()


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_fresh_siblings_of_a_parked_sample_read_their_own_prompt(backend):
    """A group updated while one sample had a token (its K/V parked, tagged) and its siblings
    none: the siblings prefill their prompt under the new weights and must go on reading those
    slots. The torch (and Triton) shared-prefix split read a group's prompt from its first
    member, the parked sample's old-weights branch: 4.65 nats off from the second token."""
    from models import tiny_model

    old = tiny_model("llama", seed=2, vocab_size=18)
    new = tiny_model("llama", seed=13, vocab_size=18)
    engine = Engine(old, EngineConfig(backend=backend, kv_cache_tokens=512, max_model_len=64,
                                      carried_kv="park"))
    prompt = [12, 5, 5, 9, 14, 5, 9]
    engine.add_request(prompt, SamplingParams(n=3, temperature=0, max_tokens=5, logprobs=True))
    engine.step()  # sample 0 has a token; 1 and 2 none
    engine.update_weights(new)
    outs = []
    while engine.has_unfinished:
        outs += engine.step()
    fresh = [s for s in outs[0].samples if s.weights_versions[0] == 1]
    assert len(fresh) == 2
    for s in fresh:
        seq = torch.tensor([prompt + s.token_ids])
        with torch.no_grad():
            want = new(seq).logits[0, len(prompt) - 1:-1].log_softmax(-1)
        want = want.gather(-1, seq[0, len(prompt):, None])[:, 0]
        assert torch.allclose(torch.tensor(s.logprobs), want, atol=1e-4)


@functools.cache
def llama(seed: int):
    from models import tiny_model

    return tiny_model("llama", seed=seed, vocab_size=128)


def one_behind(siblings: bool) -> Engine:
    """Two greedy samples of one prompt (a group of two, or two requests), the second one token
    behind the first (8 tokens a step: the first prefills alone), carried across a real update
    and a few steps under the new weights: their first two tokens are alike, and the weights
    that computed the second one's K/V differ."""
    engine = Engine(llama(0), EngineConfig(kv_cache_tokens=1024, max_model_len=48, max_num_seqs=4,
                                           max_num_batched_tokens=8, carried_kv="park"))
    prompt = list(range(10, 18))
    pair = SamplingParams(n=2 if siblings else 1, temperature=0, max_tokens=16, logprobs=True)
    asked = [prompt] if siblings else [prompt, prompt]
    got = engine.rollout([*asked, [5]], [pair] * len(asked) + [SamplingParams(max_tokens=2)],
                         groups=1, request_ids=[*("A", "A2")[:len(asked)], "B"])
    assert [o.request_id for o in got] == ["B"]
    engine.update_weights(llama(1))
    engine.generate([[7, 7, 7]], SamplingParams(temperature=0, max_tokens=3))
    return engine


def samples_of(outs) -> list:
    return [s for o in sorted(outs, key=lambda o: o.request_id) for s in o.samples]


@pytest.mark.parametrize("siblings", [True, False], ids=["siblings", "two-requests"])
def test_a_sample_one_behind_an_identical_one_keeps_its_own_kv(siblings):
    """Under unchanged weights a resumed sample attends to exactly the K/V it had, even where
    another sample holds the same tokens' K/V computed under other weights: the one behind
    computed a position under the new weights that the one ahead computed under the old ones
    (the prefix cache had swapped in the other's at the sleep's retraction: 0.047 nats off
    from its 6th token). References: the K/V bits before the sleep, the run without it."""
    want = samples_of(one_behind(siblings).rollout())
    assert [s.weights_versions[:3] for s in want] == [[0, 0, 0], [0, 0, 1]]
    assert want[0].token_ids[:2] == want[1].token_ids[:2]
    engine = one_behind(siblings)
    before = running_kv(engine)
    assert len(before) == 2
    engine.sleep(1)
    engine.wake_up()
    engine.check_invariants()
    engine.step()  # both re-admitted: their newest token only
    for seq in engine.scheduler.running:
        kv = before[seq.seq_id]
        assert torch.equal(engine.pool.buffer[:, :, engine.kv.table.read(
            seq.row, 0, kv.shape[2])], kv)
    got = samples_of(engine.rollout())
    engine.check_invariants()
    assert [s.token_ids for s in got] == [s.token_ids for s in want]
    # Exact: the K/V holds the bits it had (above), and from the wake on the steps decode the
    # rows the run without the sleep decodes, in the same batches.
    assert [s.logprobs for s in got] == [s.logprobs for s in want]
