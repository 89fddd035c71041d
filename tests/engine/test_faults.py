"""Faults injected at every point of a step: the engine stays exact and usable.

A RuntimeError or a KeyboardInterrupt is raised at one point (before the call, or after it
did its work), once, during a generate() that prefills in chunks, preempts and evicts (the
pool is small), with and without speculation and prefix caching. Afterwards: the invariants
hold, nothing runs, every slot is free or cached unlocked, and the same generate() returns
exactly what a fresh engine returns. Colocation calls (sleep, wake_up, update_weights) are
faulted the same way.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from floors import TAIL_MULTIPLE, tolerance
from models import char_tokenizer, tiny_model

import rollout.engine.engine as engine_module
import rollout.requests.outputs as outputs
from rollout import Engine, EngineConfig, SamplingParams
from rollout.engine.carry import Carry
from rollout.journal import RollbackFailed
from rollout.models.layers.packed_linear import Projection
from rollout.spec import SpeculativeConfig

TOK = char_tokenizer()
PROMPTS = ["ab 1+2=", "the cat sat on", "ab 1+2=3 and 4", "zz top", "a b c d e f"]
# Seeded sampling (truncated by top-p: sampling logprobs, supports and top-k alternatives,
# per-token state a rolled-back step must leave exact) and greedy, logprobs, stop strings
# (every stop check decodes text).
PARAMS = [SamplingParams(n=2, temperature=1.0, seed=i, max_tokens=10, logprobs=True,
                         top_p=0.9, return_support=True, stop=["q.", "\n\n"], top_logprobs=2)
          for i in range(4)] + \
         [SamplingParams(n=2, temperature=0, max_tokens=12, logprobs=True, stop=["zz"])]
SPECS = ("plain", "ngram", "draft")


@functools.cache
def target():
    return tiny_model("qwen2", vocab_size=len(TOK))


@functools.cache
def draft():
    return tiny_model("qwen2", seed=3, num_hidden_layers=1, vocab_size=len(TOK))


def make(spec: str, caching: bool, model=None, **overrides) -> Engine:
    speculative = {"plain": None,
                   "ngram": SpeculativeConfig("ngram", num_speculative_tokens=3),
                   "draft": SpeculativeConfig("draft", num_speculative_tokens=3,
                                              draft_model=draft()),
                   "suffix": SpeculativeConfig("suffix", num_speculative_tokens=3)}[spec]
    # 64 slots for 10 sequences of up to ~25 tokens: admission waits, decodes preempt.
    return Engine(model or target(), EngineConfig(kv_cache_tokens=64, max_model_len=40,
                                         max_num_batched_tokens=16, max_num_seqs=8,
                                         enable_prefix_caching=caching,
                                         speculative=speculative, **overrides), tokenizer=TOK)


def view(outs):
    return [[(s.token_ids, s.finish_reason, s.text, _support(s),
              None if s.top_logprobs is None else s.top_logprobs.ids.tolist())
             for s in o.samples] for o in outs]


def _support(sample):
    return None if sample.support is None else [ids.tolist() for ids in sample.support]


def logprobs(outs):
    """Each sample's logprobs, then its sampling logprobs."""
    return [lp for o in outs for s in o.samples for lp in (*s.logprobs, *s.sampling_logprobs)]


@functools.cache
def reference(spec: str, caching: bool):
    outs = make(spec, caching).generate(PROMPTS, PARAMS)
    return view(outs), logprobs(outs)


@functools.cache
def batch_spread(spec: str, caching: bool) -> float:
    """The engine's own largest logprob gap between batch compositions: each request alone
    against all together. A run on a warm cache, or chunked otherwise after a fault, moves
    them as much (1.4e-6 to 2.3e-6 here, on an Intel Xeon, AVX-512; AVX2: not measured)."""
    engine = make(spec, caching)
    alone = [o for prompt, params in zip(PROMPTS, PARAMS)
             for o in engine.generate([prompt], [params])]
    want, want_lps = reference(spec, caching)
    assert view(alone) == want  # each sample's tokens are its seed's, whatever its batch
    return max(abs(a - b) for a, b in zip(logprobs(alone), want_lps, strict=True))


def assert_logprobs_agree(got: list[float], want: list[float], spec: str = "plain",
                          caching: bool = True) -> None:
    """Another run's logprobs `got` as near `want` as the engine's own batch spread allows
    (floors.tolerance; TAIL_MULTIPLE: the largest gap of many tokens)."""
    bound = tolerance(batch_spread(spec, caching), torch.tensor(want, dtype=torch.float64),
                      TAIL_MULTIPLE)
    assert got == pytest.approx(want, abs=bound)


def assert_exact(engine: Engine, spec: str, caching: bool) -> None:
    outs = engine.generate(PROMPTS, PARAMS)
    want, want_lps = reference(spec, caching)
    assert view(outs) == want
    assert_logprobs_agree(logprobs(outs), want_lps, spec, caching)


def assert_clean(engine: Engine) -> None:
    """Nothing runs, nothing leaked: every slot is free or cached and unlocked."""
    engine.check_invariants()
    assert not engine.has_unfinished and not engine.running_requests
    assert engine.inspect().kv_available == engine.inspect().kv_slots


class Fault:
    """Raises `kind` at the `at`-th call of what it wraps, before or after the call runs."""

    def __init__(self, kind: type[BaseException], at: int, after: bool) -> None:
        self.kind, self.at, self.after, self.calls = kind, at, after, 0

    @property
    def fired(self) -> bool:
        return self.calls >= self.at

    def wrap(self, fn):
        @functools.wraps(fn)
        def faulty(*args, **kwargs):
            self.calls += 1
            if self.calls == self.at and not self.after:
                raise self.kind("injected fault")
            result = fn(*args, **kwargs)
            if self.calls == self.at and self.after:
                raise self.kind("injected fault")
            return result
        return faulty

    def install(self, monkeypatch, obj, name: str) -> None:
        monkeypatch.setattr(obj, name, self.wrap(getattr(obj, name)))


# point -> where it is (an object and a method name), given the engine; which specs have it;
# whether a fault after the call is meaningful (for pure bookkeeping primitives it is the same
# as one before the next call).
STEP_POINTS = {
    "schedule": (lambda e: (e.scheduler, "schedule"), SPECS, True),
    "alloc": (lambda e: (e.kv, "alloc"), SPECS, False),
    "preempt": (lambda e: (e.scheduler, "preempt"), SPECS, False),
    "drafter": (lambda e: (e.speculator.drafter, "propose_batch"), ("ngram", "draft"), True),
    "draft_forward": (lambda e: (e.speculator.drafter.stack.model, "forward"), ("draft",), True),
    "prepare": (lambda e: (e.runner, "prepare"), SPECS, True),
    "forward": (lambda e: (e.model, "forward"), SPECS, True),
    "sampler": (lambda e: (e.stack.sampler, "draw"), ("plain",), True),
    "verify": (lambda e: (e.speculator, "verify"), ("ngram", "draft"), True),
    "tokenizer": (lambda e: (e.tokenizer, "decode"), SPECS, True),
    "radix_insert": (lambda e: (e.cache, "insert"), SPECS, True),
    "commit": (lambda e: (e.committer, "commit"), SPECS, True),
    # what the verifications committed, learnt (the running acceptance, the back-off) and
    # handed to the stats
    "spec_commit": (lambda e: (e.speculator, "after_commit"), ("ngram", "draft"), True),
    "finish": (lambda e: (e.scheduler, "finish"), SPECS, False),
    "settle": (lambda e: (e.kv, "settle"), SPECS, True),
    # a finished request retired (with the version it completed under), lpm's count of how
    # often the head of the queue was passed over
    "retire": (lambda e: (e.requests, "end"), ("plain",), True),
    "passed_over": (lambda e: (e.scheduler, "_count_passed"), ("plain",), True),
}
STEP_CASES = [
    pytest.param(point, spec, after, id=f"{point}-{spec}-{'after' if after else 'before'}")
    for point, (_, specs, has_after) in STEP_POINTS.items() for spec in specs
    for after in ((False, True) if has_after else (False,))]


@pytest.mark.parametrize("caching", [True, False], ids=["cache", "nocache"])
@pytest.mark.parametrize("kind", [RuntimeError, KeyboardInterrupt], ids=["error", "interrupt"])
@pytest.mark.parametrize("point,spec,after", STEP_CASES)
def test_fault_in_a_step_leaves_the_engine_exact(point, spec, after, kind, caching, monkeypatch):
    engine = make(spec, caching)
    engine.generate(PROMPTS[:2], PARAMS[:2])  # something cached and something to evict
    fault = Fault(kind, at=2, after=after)
    fault.install(monkeypatch, *STEP_POINTS[point][0](engine))
    if point == "tokenizer" and kind is RuntimeError:
        # A failing stop check fails its own request; the others finish.
        outs = engine.generate(PROMPTS, PARAMS)
        failed = [o for o in outs if o.error is not None]
        assert failed and all("injected" in o.error for o in failed)
        assert any(s.finish_reason == "abort" for o in failed for s in o.samples)
    else:
        with pytest.raises(kind, match="injected"):
            engine.generate(PROMPTS, PARAMS)
    assert fault.fired
    monkeypatch.undo()
    assert_clean(engine)
    assert_exact(engine, spec, caching)
    assert_clean(engine)


# What generate() runs after its last step, building each output: per request, then per sample
# (text, supports, top-k alternatives: an out-of-memory torch.stack, a tokenizer's interrupt).
OUTPUT_POINTS = {
    "output": lambda e: (e, "_output"),
    "build_output": lambda e: (engine_module, "build_output"),
    "text": lambda e: (e, "_text"),
    "support": lambda e: (outputs, "Support"),
    "tops": lambda e: (outputs, "_tops"),
}
OUTPUT_CASES = [
    pytest.param(point, after, kind, id=f"{point}-{'after' if after else 'before'}-{name}")
    for point in OUTPUT_POINTS for after in (False, True)
    for kind, name in ((RuntimeError, "error"), (KeyboardInterrupt, "interrupt"))
    if not (point == "text" and kind is RuntimeError)]  # (that costs the text, not the call)


@pytest.mark.parametrize("point,after,kind", OUTPUT_CASES)
def test_fault_while_generate_builds_its_outputs(point, after, kind, monkeypatch):
    """Every request finished, some outputs built: the rest had stayed in the engine, and the
    next step() handed them out as if they were the caller's streaming requests. The call
    leaves none of its own behind; a streaming request queued before it finishes as it
    would have."""
    engine = make("plain", True)
    stream = engine.add_request(PROMPTS[1], PARAMS[1])
    fault = Fault(kind, at=3, after=after)  # requests 0 (and, per sample, 1) built already
    fault.install(monkeypatch, *OUTPUT_POINTS[point](engine))
    with pytest.raises(kind, match="injected"):
        engine.generate(PROMPTS, PARAMS)
    assert fault.fired
    monkeypatch.undo()
    engine.check_invariants()
    done = drain(engine)
    assert list(done) == [stream]
    assert view([done[stream]]) == view(make("plain", True).generate(PROMPTS[1:2], PARAMS[1]))
    assert_clean(engine)
    assert_exact(engine, "plain", True)


@pytest.mark.parametrize("kind", [RuntimeError, KeyboardInterrupt], ids=["error", "interrupt"])
def test_a_failed_generate_gives_its_unseeded_requests_seeds_back(kind, monkeypatch):
    """Unseeded requests draw their seeds from the engine's stream (EngineConfig.seed): a
    generate() that fails (and aborts its requests) gives them back, so the next call, a retry
    say, samples what a fresh engine samples (they had been spent: the retry drew other
    tokens)."""
    unseeded = [dataclasses.replace(p, seed=None) for p in PARAMS[:4]]
    engine = make("plain", True, seed=5)
    Fault(kind, at=2, after=True).install(monkeypatch, engine.model, "forward")
    with pytest.raises(kind, match="injected"):
        engine.generate(PROMPTS[:4], unseeded)
    monkeypatch.undo()
    assert_clean(engine)
    fresh = make("plain", True, seed=5).generate(PROMPTS[:4], unseeded)
    assert view(engine.generate(PROMPTS[:4], unseeded)) == view(fresh)


# Where generate() queues its requests: the call queueing them all, and each one's (a fault
# after the second rolls back the queueing unit, the first request included).
QUEUE_POINTS = {"queue": lambda e: (e, "_queue"), "enqueue": lambda e: (e, "_enqueue")}


@pytest.mark.parametrize("kind", [RuntimeError, KeyboardInterrupt], ids=["error", "interrupt"])
@pytest.mark.parametrize("point", QUEUE_POINTS)
def test_a_generate_failing_as_it_queues_leaves_nothing_queued(point, kind, monkeypatch):
    """A fault at _queue's return found its requests queued and generate()'s cleanup not
    knowing them: they stayed queued, a later step() ran and handed them out, and their seeds
    were spent (a retry sampled other tokens than a fresh engine)."""
    unseeded = [dataclasses.replace(p, seed=None) for p in PARAMS[:4]]
    engine = make("plain", True, seed=5)
    free = engine.inspect().kv_available
    fault = Fault(kind, at=1 if point == "queue" else 2, after=True)
    fault.install(monkeypatch, *QUEUE_POINTS[point](engine))
    with pytest.raises(kind, match="injected"):
        engine.generate(PROMPTS[:4], unseeded)
    assert fault.fired
    monkeypatch.undo()
    assert_clean(engine)
    assert engine.inspect().kv_available == free
    fresh = make("plain", True, seed=5).generate(PROMPTS[:4], unseeded)
    assert view(engine.generate(PROMPTS[:4], unseeded)) == view(fresh)
    assert_exact(engine, "plain", True)


@pytest.mark.parametrize("kind", [RuntimeError, KeyboardInterrupt], ids=["error", "interrupt"])
def test_failed_step_after_drafting_for_a_cached_prompt(kind, monkeypatch):
    """A request whose prompt the prefix cache holds all but the last token of decodes from
    its first step, so the draft model drafts for it before it has sampled anything, caching
    the prompt in its own tree. The target's step then fails after the draft rounds (which
    commit on their own): the draft must still be able to go back to the target's tokens (it
    once kept the whole prompt cached, one position past what the target had computed, and
    the next step crashed on an empty draft batch)."""
    engine = make("draft", True)
    # One sample: beside a sibling the empty item took the sibling's row and drafted from it.
    prompt, params = PROMPTS[1], dataclasses.replace(PARAMS[1], n=1)
    engine.generate([prompt], params)  # the prompt cached
    rid = engine.add_request(prompt, params)
    Fault(kind, at=1, after=True).install(monkeypatch, engine.model, "forward")
    with pytest.raises(kind, match="injected"):
        engine.step()
    monkeypatch.undo()
    assert engine.stats.spec_proposed > 0  # it drafted before the target's forward
    engine.check_invariants()
    done = {}
    while engine.has_unfinished:
        done.update({o.request_id: o for o in engine.step()})
        engine.check_invariants()
    fresh = make("draft", True).generate([prompt], params)
    assert view([done[rid]]) == view(fresh)


@pytest.mark.parametrize("kind", [RuntimeError, KeyboardInterrupt], ids=["error", "interrupt"])
@pytest.mark.parametrize("point", ["forward", "sampler", "tokenizer-interrupt", "commit",
                                   "settle"])
def test_failed_decode_step_changes_nothing_and_streams_go_on(point, kind, monkeypatch):
    """In steady decoding a failed step returns every slot it took: free slots and cache are
    what they were, the streaming requests are still runnable and finish exactly."""
    if point == "tokenizer-interrupt" and kind is RuntimeError:
        pytest.skip("a failing tokenizer fails its request, not the step")
    engine = make("plain", True)
    # A stop string that never matches: the stop check decodes after every token.
    params = SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=14, logprobs=True,
                            top_p=0.9, return_support=True, stop=["qqq"])
    ids = [engine.add_request(p, params) for p in PROMPTS[:2]]
    for _ in range(4):
        engine.step()
    running = engine.running_requests
    before = (engine.inspect().kv_free, engine.inspect().cached_tokens,
              engine.stats.generated_tokens)
    name = point.removesuffix("-interrupt")
    Fault(kind, at=1, after=True).install(monkeypatch, *STEP_POINTS[name][0](engine))
    with pytest.raises(kind, match="injected"):
        engine.step()
    monkeypatch.undo()
    engine.check_invariants()
    assert engine.running_requests == running
    assert (engine.inspect().kv_free, engine.inspect().cached_tokens,
            engine.stats.generated_tokens) == before
    done = {}
    while engine.has_unfinished:
        done.update({o.request_id: o for o in engine.step()})
        engine.check_invariants()
    fresh = make("plain", True).generate(PROMPTS[:2], params)
    assert view([done[i] for i in ids]) == view(fresh)
    assert_logprobs_agree(logprobs([done[i] for i in ids]), logprobs(fresh))


# --- colocation calls --------------------------------------------------------------------------
SLEEP_POINTS = {
    "park": (lambda e: (e.stack.parking, "park"), SPECS),
    "pool_release": (lambda e: (e.pool, "release"), SPECS),
    "draft_sleep": (lambda e: (e.speculator.drafter, "sleep"), ("draft",)),
}
WAKE_POINTS = {
    "restore": (lambda e: (e.stack.parking, "restore"), SPECS),
    "pool_allocate": (lambda e: (e.pool, "allocate"), SPECS),
    "draft_wake": (lambda e: (e.speculator.drafter, "wake_up"), ("draft",)),
    "pack": (lambda e: (e.model, "pack_weights"), SPECS),  # CPU: the oneDNN-packed copies
}


def _cases(points):
    return [pytest.param(point, spec, after, id=f"{point}-{spec}-{'after' if after else 'before'}")
            for point, (_, specs) in points.items() for spec in specs for after in (False, True)]


@pytest.mark.parametrize("kind", [RuntimeError, KeyboardInterrupt], ids=["error", "interrupt"])
@pytest.mark.parametrize("level", [1, 2])
@pytest.mark.parametrize("point,spec,after", _cases(SLEEP_POINTS))
def test_failed_sleep_leaves_the_engine_awake(point, spec, after, level, kind, monkeypatch):
    engine = make(spec, True)
    engine.generate(PROMPTS[:2], PARAMS[:2])
    Fault(kind, at=1, after=after).install(monkeypatch, *SLEEP_POINTS[point][0](engine))
    with pytest.raises(kind, match="injected"):
        engine.sleep(level)
    monkeypatch.undo()
    assert not engine.is_sleeping
    assert_clean(engine)
    if engine.needs_weights:  # a level-2 park got as far as dropping weights
        assert level == 2
        with pytest.raises(RuntimeError, match="update_weights"):
            engine.generate(PROMPTS, PARAMS)
        engine.update_weights(target())
    assert_exact(engine, spec, True)
    engine.sleep(level)  # and the next cycle works
    engine.wake_up()
    if level == 2:
        engine.update_weights(target())
    assert_exact(engine, spec, True)


@pytest.mark.parametrize("kind", [RuntimeError, KeyboardInterrupt], ids=["error", "interrupt"])
@pytest.mark.parametrize("point,spec,after", _cases(WAKE_POINTS))
def test_failed_wake_up_leaves_the_engine_asleep(point, spec, after, kind, monkeypatch):
    engine = make(spec, True)
    engine.generate(PROMPTS[:2], PARAMS[:2])
    engine.sleep(1)
    Fault(kind, at=1, after=after).install(monkeypatch, *WAKE_POINTS[point][0](engine))
    with pytest.raises(kind, match="injected"):
        engine.wake_up()
    monkeypatch.undo()
    assert engine.is_sleeping and not engine.inspect().kv_bytes
    engine.check_invariants()
    with pytest.raises(RuntimeError, match="asleep"):
        engine.generate(PROMPTS, PARAMS)
    engine.wake_up()
    assert_clean(engine)
    assert_exact(engine, spec, True)


@pytest.mark.parametrize("kind", [RuntimeError, KeyboardInterrupt], ids=["error", "interrupt"])
@pytest.mark.parametrize("spec", SPECS)
def test_update_weights_failing_half_way_is_refused_until_complete(spec, kind, monkeypatch):
    engine = make(spec, True)
    engine.generate(PROMPTS[:2], PARAMS[:2])
    other = tiny_model("qwen2", seed=11, vocab_size=len(TOK))
    Fault(kind, at=3, after=True).install(monkeypatch, engine.model, "load_weights")
    with pytest.raises(RuntimeError if kind is RuntimeError else kind):
        engine.update_weights(other, bucket_bytes=1)  # one bucket per tensor
    monkeypatch.undo()
    assert engine.needs_weights
    assert_clean(engine)
    assert engine.inspect().cached_tokens == 0, "K/V of the old weights must go"
    with pytest.raises(RuntimeError, match="update_weights"):
        engine.generate(PROMPTS, PARAMS)
    engine.update_weights(target())
    assert not engine.needs_weights
    assert_exact(engine, spec, True)


@pytest.mark.parametrize("kind", [RuntimeError, KeyboardInterrupt], ids=["error", "interrupt"])
@pytest.mark.parametrize("after", [False, True], ids=["before", "after"])
def test_update_weights_interrupted_while_packing_generates_from_the_new_weights(
        kind, after, monkeypatch):
    """The weights are all copied when the packed copies are made: a fault at the third of
    them leaves some packed from the old weights, which their next use must notice."""
    engine = make("plain", True)
    engine.generate(PROMPTS[:2], PARAMS[:2])
    other = tiny_model("qwen2", seed=11, vocab_size=len(TOK))
    Fault(kind, at=3, after=after).install(monkeypatch, Projection, "pack")
    with pytest.raises(kind, match="injected"):
        engine.update_weights(other)
    monkeypatch.undo()
    assert not engine.needs_weights
    assert_clean(engine)
    outs, want = engine.generate(PROMPTS, PARAMS), make("plain", True, other).generate(PROMPTS,
                                                                                        PARAMS)
    assert view(outs) == view(want)
    assert_logprobs_agree(logprobs(outs), logprobs(want))  # the same arithmetic, other weights


def test_rollback_of_a_step_that_preempted_keeps_the_preemption_only():
    """Scheduling commits on its own (its decisions are valid states); the forward's failure
    discards only what came after it."""
    engine = make("plain", True)
    params = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=16)
    ids = [engine.add_request(p, params) for p in PROMPTS]
    preempted = 0
    forward = engine.model.forward
    calls = []

    def failing_forward(*args, **kwargs):
        calls.append(engine.stats.preemptions)
        if engine.stats.preemptions > preempted and len(calls) % 2:
            raise RuntimeError("injected fault")
        return forward(*args, **kwargs)

    engine.model.forward = failing_forward
    done, failures = {}, 0
    while engine.has_unfinished:
        try:
            done.update({o.request_id: o for o in engine.step()})
        except RuntimeError:
            failures += 1
        engine.check_invariants()
    del engine.model.forward
    assert failures > 0 and engine.stats.preemptions > 0
    fresh = make("plain", True).generate(PROMPTS, params)
    assert view([done[i] for i in ids]) == view(fresh)


def test_check_invariants_on_a_sleeping_engine():
    engine = make("draft", True)
    engine.generate(PROMPTS[:1], PARAMS[:1])
    engine.sleep(2)
    engine.check_invariants()
    engine.wake_up()
    engine.check_invariants()


# --- KV holds of multi-turn episodes -------------------------------------------------------------
# Turn 1 holds each finished sample's KV; turn 2 resumes every hold (released once admitted on
# top of it) and holds again; the small pool drops holds and preempts. A fault at a step point
# of turn 2 must leave holds, their locks and the stepping exact.
HOLD_CASES = [case for case in STEP_CASES if case.values[1] == "plain"
              and case.values[0] != "tokenizer"]  # a failing stop check fails its request
TURN1 = SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=8, logprobs=True, stop=["q."])
OBSERVATION = TOK.encode(" ok=")


def drain(engine: Engine, fault_kind=None, monkeypatch=None) -> dict:
    """Step until nothing runs; a step that raises `fault_kind` (at most once) is checked to have
    left the invariants and is stepped past, as a caller catching it would."""
    done, raised = {}, False
    while engine.has_unfinished:
        try:
            outs = engine.step()
        except BaseException as e:  # noqa: BLE001  (the injected fault, of either kind)
            assert fault_kind is not None and isinstance(e, fault_kind) and not raised
            raised = True
            monkeypatch.undo()
            engine.check_invariants()
            continue
        done.update({o.request_id: o for o in outs})
    assert raised == (fault_kind is not None)
    return done


def held_turns(engine: Engine, arm=None) -> tuple[list, list]:
    """Both turns' samples (view, logprobs) in request order, and turn 2's hold keys;
    `arm(engine)` installs the fault before turn 2 and returns the kind it raises."""
    first = [engine.add_request(p, TURN1, hold_kv=True) for p in PROMPTS[:3]]
    done = drain(engine)
    assert len(engine.inspect().holds) + engine.stats.holds_dropped == 6
    second = []
    for rid in first:
        out = done[rid]
        for s in out.samples:
            params = SamplingParams(temperature=1.0, seed=11 + s.index, max_tokens=14,
                                    logprobs=True)
            ids = list(out.prompt_token_ids) + list(s.token_ids) + OBSERVATION
            second.append(engine.add_request(ids, params, hold_kv=True, resume=(rid, s.index)))
    kind, monkeypatch = arm(engine) if arm else (None, None)
    done.update(drain(engine, kind, monkeypatch))
    outs = [done[rid] for rid in first + second]
    return (view(outs), logprobs(outs)), [(rid, 0) for rid in second]


@functools.cache
def held_reference():
    return held_turns(make("plain", True))[0]


class FaultOnHold(Fault):
    """Raises `kind` right after the first call during which a sample took its hold: the
    step's rollback has a hold to undo."""

    def __init__(self, kind: type[BaseException], engine: Engine) -> None:
        super().__init__(kind, at=0, after=True)
        self.engine = engine

    def wrap(self, fn):
        @functools.wraps(fn)
        def faulty(*args, **kwargs):
            before = set(self.engine.inspect().holds)
            result = fn(*args, **kwargs)
            if not self.calls and set(self.engine.inspect().holds) - before:
                self.calls = 1
                raise self.kind("injected fault")
            return result
        return faulty


@pytest.mark.parametrize("kind", [RuntimeError, KeyboardInterrupt], ids=["error", "interrupt"])
@pytest.mark.parametrize("point,spec,after,moment", [
    *[pytest.param(*case.values, "first", id=f"{case.id}-first") for case in HOLD_CASES],
    # Holds are taken in the commit; turn 2's first schedule releases the resumed ones.
    pytest.param("commit", "plain", True, "on-hold", id="commit-on-hold")])
def test_fault_beside_kv_holds_leaves_holds_exact(point, spec, after, moment, kind,
                                                  monkeypatch):
    engine = make(spec, True)
    # "first": turn 2's first call of the point (turn 2 preempts once); "on-hold": right after
    # the call in which a turn-2 sample took its hold.
    fault = Fault(kind, at=1, after=after) if moment == "first" else FaultOnHold(kind, engine)

    def arm(e):
        fault.install(monkeypatch, *STEP_POINTS[point][0](e))
        return kind, monkeypatch

    samples, turn2_keys = held_turns(engine, arm)
    assert fault.fired
    want = held_reference()
    assert samples[0] == want[0]
    assert_logprobs_agree(samples[1], want[1])
    engine.check_invariants()
    # Every turn-1 hold was resumed (released) or dropped; what is held is turn 2's, and
    # releasing it leaves no lock behind.
    assert set(engine.inspect().holds) <= set(turn2_keys)
    for key in list(engine.inspect().holds):
        assert engine.release_hold(key)
    assert_clean(engine)


@pytest.mark.parametrize("call", ["generate", "score"])
def test_a_rollback_failing_while_a_failed_call_gives_up_its_requests_breaks_the_engine(
        call, monkeypatch):
    """A failed call aborts its requests, each in a unit; an undo of that unit failing in turn
    (RollbackFailed: the bookkeeping unknown) must end every later call with "build a new
    Engine", not be taken for an abort's failure and retried (the engine had served on)."""
    eng = make("plain", True)
    real_abort = Carry.abort
    failed = []

    def broken_undo():
        raise RuntimeError("an undo failing")

    def abort(self, request, keep_kv):
        if not failed:
            failed.append(request.request_id)
            self.journal.record(broken_undo)
            raise RuntimeError("an abort failing")
        return real_abort(self, request, keep_kv)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(Carry, "abort", abort)
    monkeypatch.setattr(eng, "_step_until", interrupted)
    run = {"generate": lambda: eng.generate(PROMPTS[:2], PARAMS[0]),
           "score": lambda: eng.score([TOK.encode("ab 1+2=3")])}[call]
    with pytest.raises(RollbackFailed):
        run()
    assert failed  # the rig held
    monkeypatch.undo()
    with pytest.raises(RuntimeError, match="build a new Engine"):
        eng.generate(PROMPTS[:1], PARAMS[0])
