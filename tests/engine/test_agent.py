"""Multi-turn episodes (rollout.agent): token-in/token-out against a transformers forward over
the episode, masks, KV served by the prefix cache across turns, holds under a small pool,
failing and slow environments, budgets, chat-message observations."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import os
import random
import re
import threading
import time

import pytest
import torch
from floors import assert_within_floor, exact_copy, token_logprobs
from models import always_picks, char_tokenizer, tiny_model
from test_faults import Fault

import rollout.agent
import rollout.env_calls
import rollout.engine.engine
from rollout import Engine, EngineConfig, SamplingParams
from rollout.agent import Step, message_tokens, run_episodes
from rollout.env_calls import EnvCalls
from rollout.engine.requests import RequestTable

TOK = char_tokenizer()
PROMPTS = ["ab 1+2=", "the cat", "zz top 9"]
OBS = "<r>42</r>\n"


@functools.cache
def model():
    return tiny_model("llama", vocab_size=len(TOK))


def engine(**kw) -> Engine:
    cfg = dict(kv_cache_tokens=4096, max_model_len=256)
    cfg.update(kw)
    return Engine(model(), EngineConfig(**cfg), tokenizer=TOK)


class Echo:
    """Answers every turn with OBS, rewards 1 per turn, done after `turns` turns."""

    def __init__(self, turns: int = 3, observation=OBS) -> None:
        self.turns, self.observation, self.seen = turns, observation, []

    def reset(self, prompt_ids):
        self.prompt_ids = prompt_ids

    def step(self, turn_ids, text):
        self.seen.append((list(turn_ids), text))
        return Step(observation=self.observation, reward=1.0, done=len(self.seen) >= self.turns)


PARAMS = SamplingParams(n=3, temperature=1.0, max_tokens=8, seed=5)


def summary(episodes):
    return [[(e.token_ids, e.mask, e.turns, e.finish_reason, e.reward) for e in row]
            for row in episodes]


def test_episode_tokens_are_what_the_model_was_conditioned_on():
    """Each model token's logprob is log_softmax of a transformers forward over prompt +
    token_ids (the history is never re-tokenised), to the float64 floor (floors.py); env tokens
    are the observation's own tokenisation, masked 0 with logprob 0."""
    episodes = run_episodes(engine(), PROMPTS, Echo, PARAMS, max_turns=5)
    obs = TOK.encode(OBS, add_special_tokens=False)
    exact = exact_copy(model())
    errors, floors, values = [], [], []
    for row in episodes:
        assert len(row) == PARAMS.n
        for ep in row:
            assert ep.finish_reason == "done" and ep.turns == 3 and ep.reward == 3.0
            assert len(ep.token_ids) == len(ep.mask) == len(ep.logprobs)
            full = ep.prompt_ids + ep.token_ids
            with torch.no_grad():
                logits = model()(torch.tensor([full])).logits[0].float()
            ref = logits[len(ep.prompt_ids) - 1:-1].log_softmax(-1)
            ref = ref.gather(-1, torch.tensor(ep.token_ids)[:, None]).squeeze(-1)
            mask = torch.tensor(ep.mask, dtype=torch.bool)
            got = torch.tensor(ep.logprobs)
            truth = token_logprobs(exact, ep.prompt_ids, ep.token_ids)[mask]
            errors.append((got[mask].double() - truth).abs())
            floors.append((ref[mask].double() - truth).abs())
            values.append(truth)
            assert bool((got[~mask] == 0).all())
            # Environment tokens: two observations of OBS's own tokens, between model turns.
            runs = _runs(ep.mask)
            assert [m for m, _ in runs] == [1, 0, 1, 0, 1]
            assert [n for m, n in runs if m == 0] == [len(obs)] * 2
            at = runs[0][1]
            assert ep.token_ids[at:at + len(obs)] == obs
    assert_within_floor(torch.cat(errors), torch.cat(floors), torch.cat(values))


def _runs(mask):
    out = []
    for m in mask:
        if out and out[-1][0] == m:
            out[-1][1] += 1
        else:
            out.append([m, 1])
    return [tuple(r) for r in out]


def test_each_turn_computes_only_the_observation_and_one_token():
    eng = engine()
    episodes = run_episodes(eng, PROMPTS, Echo, PARAMS, max_turns=5)
    obs = len(TOK.encode(OBS, add_special_tokens=False))
    later_turns = sum(ep.turns - 1 for row in episodes for ep in row)
    # The first turn: each prompt once, and its last token once more per sibling sample.
    first = sum(len(TOK.encode(p)) + PARAMS.n - 1 for p in PROMPTS)
    stats = eng.stats
    assert stats.prompt_tokens_computed <= first + later_turns * (obs + 1)
    assert stats.holds_dropped == 0
    eng.check_invariants()
    assert eng.kv.available == eng.kv.num_slots, "holds released at the end"


def test_same_seed_same_episodes_whatever_the_env_timing():
    class Jittery(Echo):
        def step(self, turn_ids, text):
            time.sleep(random.random() * 0.02)
            return super().step(turn_ids, text)

    a = run_episodes(engine(), PROMPTS, Jittery, PARAMS, max_turns=5, env_workers=4)
    b = run_episodes(engine(), PROMPTS, Jittery, PARAMS, max_turns=5, env_workers=2)
    assert summary(a) == summary(b)


def test_unseeded_episodes_follow_the_engines_seed():
    """Unseeded episodes draw their seed from EngineConfig.seed's stream, as unseeded
    requests do (they had drawn from the process-wide random module)."""
    unseeded = SamplingParams(n=3, temperature=1.0, max_tokens=8)
    runs = [summary(run_episodes(engine(seed=s), PROMPTS, Echo, unseeded, max_turns=3))
            for s in (0, 0, 1)]
    assert runs[0] == runs[1] != runs[2]
    # A run refused (a prompt out of the vocabulary) or failed half way (an interrupt in an
    # environment) gives its seed back: the next run samples what a fresh engine's first does.

    class Interrupted(Echo):
        def step(self, turn_ids, text):
            raise KeyboardInterrupt

    eng = engine(seed=0)
    with pytest.raises(ValueError):
        run_episodes(eng, [PROMPTS[0], [10**6]], Echo, unseeded, max_turns=3)
    with pytest.raises(KeyboardInterrupt):
        run_episodes(eng, PROMPTS, Interrupted, unseeded, max_turns=3)
    assert summary(run_episodes(eng, PROMPTS, Echo, unseeded, max_turns=3)) == runs[0]


def test_an_empty_run_draws_no_seed():
    """run_episodes of no prompts (a data loader's empty last batch) had drawn the run's seed
    from the engine's stream: the next unseeded run sampled other episodes than a fresh
    engine's, where generate([]) draws nothing."""
    unseeded = SamplingParams(n=3, temperature=1.0, max_tokens=8)
    eng = engine(seed=0)
    assert run_episodes(eng, [], Echo, unseeded) == []
    assert summary(run_episodes(eng, PROMPTS, Echo, unseeded, max_turns=3)) == \
        summary(run_episodes(engine(seed=0), PROMPTS, Echo, unseeded, max_turns=3))


def test_small_pool_drops_holds_and_gives_the_same_episodes():
    """Under memory pressure held episodes are released oldest first and recomputed."""
    params = SamplingParams(n=4, temperature=1.0, max_tokens=10, seed=1)
    prompts = [p * 3 for p in PROMPTS]
    large = run_episodes(engine(), prompts, functools.partial(Echo, 4), params, max_turns=5)
    small_engine = engine(kv_cache_tokens=256, max_model_len=128)
    small = run_episodes(small_engine, prompts, functools.partial(Echo, 4), params,
                         max_turns=5)
    assert summary(small) == summary(large)
    assert small_engine.stats.holds_dropped > 0 and small_engine.stats.preemptions > 0
    small_engine.check_invariants()


def test_failing_environment_aborts_only_its_episode():
    made = []

    class Failing(Echo):
        def __init__(self):
            super().__init__()
            made.append(self)
            self.fail = len(made) == 2

        def step(self, turn_ids, text):
            if self.fail and self.seen:
                raise RuntimeError("tool crashed")
            return super().step(turn_ids, text)

    eng = engine()
    episodes = [ep for row in run_episodes(eng, PROMPTS, Failing, PARAMS) for ep in row]
    failed = [ep for ep in episodes if ep.finish_reason == "abort"]
    assert len(failed) == 1 and "tool crashed" in failed[0].error and failed[0].turns == 2
    assert all(ep.finish_reason == "done" for ep in episodes if ep is not failed[0])
    eng.check_invariants()
    assert eng.kv.available == eng.kv.num_slots


def assert_no_kv_held(eng):
    assert not eng.inspect().holds and not eng.has_unfinished
    eng.check_invariants()
    assert eng.kv.available == eng.kv.num_slots


class AsyncStepOfTwoArguments(Echo):
    async def step(self, turn_ids):  # (text forgotten)
        return Step(done=True)


class SyncStepOfTwoArguments(Echo):
    def step(self, turn_ids):
        return Step(done=True)


class NoStep:
    pass


@pytest.mark.parametrize("env,error", [
    (SyncStepOfTwoArguments, "environment step: TypeError: .*takes 2 positional arguments"),
    (AsyncStepOfTwoArguments, "environment step: TypeError: .*takes 2 positional arguments"),
    (NoStep, "environment: a NoStep has no step method")], ids=["sync", "async", "no step"])
def test_a_step_that_cannot_be_called_aborts_its_episodes(env, error):
    """An async step that fails as it is called (arguments it does not take) or an environment
    without one had failed the whole run (the latter after every prompt's first turn), where
    the synchronous step's failure ends its own episode: each ends its own episode."""
    eng = engine()
    episodes = [ep for row in run_episodes(eng, PROMPTS, env, PARAMS) for ep in row]
    assert all(ep.finish_reason == "abort" and re.match(error, ep.error) for ep in episodes), \
        [ep.error for ep in episodes]
    assert_no_kv_held(eng)


def test_a_failed_reset_releases_its_first_turn_kv():
    """The first turn is one request for all of a prompt's episodes: the sample of an
    episode whose reset failed is generated too, and its KV hold released."""
    made = []

    class BadReset(Echo):
        def __init__(self):  # (made in episode order; resets run concurrently)
            super().__init__()
            made.append(self)
            self.fail = len(made) == 2

        def reset(self, prompt_ids):
            if self.fail:
                raise RuntimeError("bad reset")
    eng = engine()
    episodes = run_episodes(eng, PROMPTS[:1], BadReset, PARAMS)[0]
    assert [ep.finish_reason for ep in episodes] == ["done", "abort", "done"]
    assert "bad reset" in episodes[1].error
    assert_no_kv_held(eng)


def test_a_slow_reset_does_not_hold_back_the_other_episodes():
    """One environment's reset (a sandbox booting) finishes only once another episode has
    had its first step: the first turns had all waited for every reset. Its own episode
    waits for it (its first turn parked, its KV held); a reset failing after its first turn
    was sampled ends its episode as a reset failing before does, with no tokens; the others
    are a fresh engine's."""
    made, others_stepped, waited = [], threading.Event(), []

    class SlowReset(Echo):
        def __init__(self):
            super().__init__()
            made.append(self)

        def reset(self, prompt_ids):
            super().reset(prompt_ids)
            if self in made[:2]:  # the first fails, the second goes on
                waited.append(others_stepped.wait(timeout=5))
                if self is made[0]:
                    raise RuntimeError("sandbox failed")

        def step(self, turn_ids, text):
            assert self.prompt_ids  # never before its reset
            if self not in made[:2]:
                others_stepped.set()
            return super().step(turn_ids, text)

    eng = engine()
    episodes = run_episodes(eng, PROMPTS, SlowReset, PARAMS, env_workers=4)
    assert waited == [True, True]
    failed = episodes[0][0]
    assert (failed.finish_reason, failed.token_ids, failed.turns) == ("abort", [], 0)
    assert "sandbox failed" in failed.error
    assert summary(episodes)[0][1:] == reference_episodes()[0][1:]
    assert summary(episodes)[1:] == reference_episodes()[1:]
    assert_no_kv_held(eng)


@pytest.mark.parametrize("kind", [RuntimeError, KeyboardInterrupt], ids=["error", "interrupt"])
@pytest.mark.parametrize("where", ["while parked", "at its replay"])
def test_a_run_failing_around_a_parked_first_turn_leaves_no_kv_held(where, kind, monkeypatch):
    """A first turn sampled before its episode's reset answered waits, its KV held: a fault
    while it waits (as the next sample's turn is taken) or as it goes to its environment once
    the reset answered fails the run with nothing held, and a rerun gives a fresh engine's
    episodes."""
    made, release, parked = [], threading.Event(), []

    class SlowFirstReset(Echo):
        def __init__(self):
            super().__init__()
            made.append(self)

        def reset(self, prompt_ids):
            super().reset(prompt_ids)
            if self is made[0]:
                release.wait(timeout=5)

    turn = rollout.agent._Runner._model_turn

    def faulty(self, live, *args):
        first = live.env is made[0]
        if (where == "while parked" and parked and not first) or (
                where == "at its replay" and first and not live.resetting):
            raise kind("injected")
        turn(self, live, *args)
        if first and live.parked is not None:
            parked.append(live)
            if where == "at its replay":
                release.set()
    monkeypatch.setattr(rollout.agent._Runner, "_model_turn", faulty)
    eng = engine()
    try:
        with pytest.raises(kind, match="injected"):
            run_episodes(eng, PROMPTS, SlowFirstReset, PARAMS, env_workers=4)
    finally:
        release.set()
    assert parked
    monkeypatch.undo()
    assert_no_kv_held(eng)
    assert summary(run_episodes(eng, PROMPTS, Echo, PARAMS)) == reference_episodes()
    assert_no_kv_held(eng)


@pytest.mark.parametrize("where", ["environment", "model turn"])
def test_a_run_that_fails_midway_leaves_no_kv_held(where, monkeypatch):
    """An environment raising SystemExit, or Ctrl-C while a step's outputs are being taken
    (some requests' samples already holding KV, not yet handed to their episodes): the run
    raises, and every hold is released, nothing left running."""
    calls = []
    if where == "environment":
        class Exiting(Echo):
            def step(self, turn_ids, text):
                calls.append(1)
                if len(calls) == 2:
                    raise SystemExit("env exits")
                return super().step(turn_ids, text)
        env, kind = Exiting, SystemExit
    else:
        turn = rollout.agent._Runner._model_turn

        def interrupted(self, *args):
            calls.append(1)
            if len(calls) == 2:
                raise KeyboardInterrupt
            return turn(self, *args)
        monkeypatch.setattr(rollout.agent._Runner, "_model_turn", interrupted)
        env, kind = functools.partial(Echo, 100), KeyboardInterrupt
    eng = engine()
    with pytest.raises(kind):
        run_episodes(eng, PROMPTS, env, PARAMS)
    assert_no_kv_held(eng)


@functools.cache
def reference_episodes():
    return summary(run_episodes(engine(), PROMPTS, Echo, PARAMS))


# Points on the way from an environment's answer to the next turn's request, whether a fault
# after the call is meaningful, and which call is the first environment turn's (the 4th: calls
# 1-3 are the prompts' first turns; check_request's 7th, the run checking every prompt first).
BETWEEN_TURNS = {
    "seed": (lambda: (rollout.agent._Runner, "_seed"), True, 4),
    "budget": (lambda: (rollout.agent._Runner, "_budget"), True, 4),
    # after it returned: the request queued, as for an interrupt before the run took its id
    "add_request": (lambda: (Engine, "add_request"), True, 4),
    # inside add_request, before and in its unit (which queues nothing then)
    "check_request": (lambda: (rollout.engine.engine, "check_request"), True, 7),
    "make": (lambda: (RequestTable, "make"), True, 4),
}


@pytest.mark.parametrize("kind", [RuntimeError, KeyboardInterrupt], ids=["error", "interrupt"])
@pytest.mark.parametrize("point,after", [
    pytest.param(point, after, id=f"{point}-{'after' if after else 'before'}")
    for point, (_, has_after, _) in BETWEEN_TURNS.items()
    for after in (False, True)[:1 + has_after]])
def test_a_run_that_fails_between_turns_leaves_no_kv_held(point, after, kind, monkeypatch):
    """A fault after an environment answered, before the next turn's request is queued: the
    episode is then neither waiting for its environment nor running, and its hold (the turn
    just sampled) had stayed locked. The run raises with nothing held, and a rerun gives a
    fresh engine's episodes."""
    eng = engine()
    where, _, at = BETWEEN_TURNS[point]
    fault = Fault(kind, at=at, after=after)
    fault.install(monkeypatch, *where())
    with pytest.raises(kind, match="injected"):
        run_episodes(eng, PROMPTS, Echo, PARAMS)
    assert fault.fired
    monkeypatch.undo()
    assert_no_kv_held(eng)
    assert summary(run_episodes(eng, PROMPTS, Echo, PARAMS)) == reference_episodes()
    assert_no_kv_held(eng)


@pytest.mark.parametrize("kind", [RuntimeError, KeyboardInterrupt], ids=["error", "interrupt"])
def test_a_run_failing_as_its_first_turn_is_queued_leaves_nothing_running(kind, monkeypatch):
    """add_request raising after it queued a prompt's first turn (all of its episodes' samples):
    the run's cleanup had not known that request, which ran on in the engine (not idle, its
    KV in use) until the caller called abort_all(). An unseeded run gives its seed back too."""
    unseeded = dataclasses.replace(PARAMS, seed=None)
    eng, fresh = engine(seed=3), engine(seed=3)
    free = eng.kv.available
    fault = Fault(kind, at=2, after=True)
    fault.install(monkeypatch, Engine, "add_request")
    with pytest.raises(kind, match="injected"):
        run_episodes(eng, PROMPTS, Echo, unseeded)
    assert fault.fired
    monkeypatch.undo()
    assert_no_kv_held(eng)
    assert eng.kv.available == free
    assert summary(run_episodes(eng, PROMPTS, Echo, unseeded)) == \
        summary(run_episodes(fresh, PROMPTS, Echo, unseeded))
    assert_no_kv_held(eng)


def test_a_failed_run_does_not_wait_for_a_slow_environment():
    """Ctrl-C from one environment while another's step is still running: the run raises
    at once (the slow step is left to finish on its own), with no KV held."""
    started, release, finished = threading.Event(), threading.Event(), []
    made = []

    class SlowOrInterrupting(Echo):
        def __init__(self):
            super().__init__(100)
            made.append(self)
            self.slow = len(made) == 1

        def step(self, turn_ids, text):
            if self.slow:
                started.set()
                release.wait(30)
                finished.append(1)
            else:
                started.wait(30)
                raise KeyboardInterrupt
            return super().step(turn_ids, text)
    eng = engine()
    with pytest.raises(KeyboardInterrupt):
        run_episodes(eng, PROMPTS[:1], SlowOrInterrupting, PARAMS)
    assert not finished  # returned while the slow step still ran
    release.set()
    assert_no_kv_held(eng)


def test_an_async_reset_inside_a_running_event_loop():
    """Called from code that runs an event loop (a notebook), an async environment's reset
    and steps run as they do elsewhere."""
    class AsyncEcho(Echo):
        async def reset(self, prompt_ids):
            await asyncio.sleep(0)
            self.prompt_ids = prompt_ids

        async def step(self, turn_ids, text):
            await asyncio.sleep(0)
            return Echo.step(self, turn_ids, text)

    async def main():
        return run_episodes(engine(), PROMPTS[:1], AsyncEcho, PARAMS)
    episodes = asyncio.run(main())[0]
    assert [ep.finish_reason for ep in episodes] == ["done"] * 3


def run_or_hang(eng, *args, collect: list | None = None, **kwargs):
    """What run_episodes raised (None: it returned; its episodes then extend `collect`), run
    on a thread so that a hang fails the test instead of stalling the suite."""
    raised = []

    def run():
        try:
            (collect if collect is not None else []).extend(run_episodes(eng, *args, **kwargs))
            raised.append(None)
        except BaseException as e:
            raised.append(e)
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(30)
    assert not thread.is_alive(), "run_episodes hung"
    return raised[0]


def raising_async(kind, where: str, form: str):
    """An Echo whose second reset or step (`where`) raises `kind`, as a coroutine function or
    as a synchronous method returning a coroutine."""
    calls = []

    async def answer(env, call, *args):
        if call == where:
            calls.append(call)
            if len(calls) == 2:
                raise kind("injected")
        return getattr(Echo, call)(env, *args)

    class Raising(Echo):
        if form == "coroutine function":
            async def reset(self, prompt_ids):
                return await answer(self, "reset", prompt_ids)

            async def step(self, turn_ids, text):
                return await answer(self, "step", turn_ids, text)
        else:
            def reset(self, prompt_ids):
                return answer(self, "reset", prompt_ids)

            def step(self, turn_ids, text):
                return answer(self, "step", turn_ids, text)
    return Raising


@pytest.mark.parametrize("env_timeout", [None, 2.0], ids=["no-timeout", "timeout"])
@pytest.mark.parametrize("form", ["coroutine function", "method returning a coroutine"])
@pytest.mark.parametrize("kind", [KeyboardInterrupt, SystemExit])
@pytest.mark.parametrize("where", ["reset", "step"])
def test_an_async_environment_raising_an_interrupt_fails_the_run(where, kind, form,
                                                                 env_timeout):
    """asyncio raises a task's KeyboardInterrupt or SystemExit out of its loop as well: the
    loop's thread had ended before the run's future got it, and the run waited for ever (with
    env_timeout, the interrupt was lost and every episode on that loop ended as timed out).
    The run raises it, as for a synchronous environment, with nothing held; a rerun gives a
    fresh engine's episodes."""
    eng = engine()
    raised = run_or_hang(eng, PROMPTS, raising_async(kind, where, form), PARAMS,
                         env_timeout=env_timeout)
    assert type(raised) is kind and str(raised) == "injected", raised
    assert_no_kv_held(eng)
    assert summary(run_episodes(eng, PROMPTS, Echo, PARAMS)) == reference_episodes()
    assert_no_kv_held(eng)


def test_an_event_loop_goes_on_after_a_coroutine_raised_an_interrupt():
    """The other environments on that loop are still served."""
    calls = EnvCalls(1)

    async def interrupt():
        raise KeyboardInterrupt("injected")

    async def answer():
        return 7
    try:
        with pytest.raises(KeyboardInterrupt, match="injected"):
            calls.call(0, interrupt).result(timeout=30)
        assert calls.call(0, answer).result(timeout=30) == 7
    finally:
        calls.close(wait=True)


def test_loops_held_by_blocking_coroutines_are_waited_for_once_together(monkeypatch):
    """Async steps that block their loops (a synchronous client inside async code, hung),
    given up on at env_timeout: the end of the run waits CLOSE_WAIT for their cancellation
    once, for all the loops together; it had waited twice CLOSE_WAIT per loop, one loop after
    the other (80 s with the 8 default loops, before a Ctrl-C's run raised too). Each loop
    closes itself once it is let go."""
    close_wait = 0.5
    monkeypatch.setattr(rollout.env_calls, "CLOSE_WAIT", close_wait)
    calls, release = EnvCalls(4), threading.Event()

    async def blocks():
        release.wait(30)
    for future in [calls.call(slot, blocks) for slot in range(4)]:
        future.cancel()  # as run_episodes gives up on each
    start = time.monotonic()
    try:
        calls.close(wait=True)
        took = time.monotonic() - start
    finally:
        release.set()
    assert took < 2 * close_wait  # (the old close of one such loop alone took 2 CLOSE_WAIT)
    for loop in calls.loops:
        loop.thread.join(30)
        assert not loop.thread.is_alive() and loop.loop.is_closed()


@pytest.mark.parametrize("coroutine", [False, True], ids=["sync", "async"])
def test_resets_run_concurrently(coroutine):
    """Every reset is under way before any is waited on (the run's thread had waited for each
    before making the next environment): synchronous ones up to env_workers at a time; the
    episodes are the same."""
    lock, running, most = threading.Lock(), [0], [0]

    def count(change):
        with lock:
            running[0] += change
            most[0] = max(most[0], running[0])

    class SlowReset(Echo):
        def sync_reset(self, prompt_ids):
            count(1)
            time.sleep(0.2)
            count(-1)
            return Echo.reset(self, prompt_ids)

        async def async_reset(self, prompt_ids):
            count(1)
            await asyncio.sleep(0.2)
            count(-1)
            return Echo.reset(self, prompt_ids)

        reset = async_reset if coroutine else sync_reset

    episodes = run_episodes(engine(), PROMPTS, SlowReset, PARAMS, env_workers=4)
    assert summary(episodes) == reference_episodes()
    assert most[0] > 1
    if not coroutine:
        assert most[0] <= 4


def test_env_timeout_counts_from_when_a_call_starts_running():
    """9 synchronous resets of 0.2 s on 2 workers, env_timeout 0.5 s: the later ones wait for
    a worker longer than that, and none may time out for it (timed from the queue, the last
    ones had been aborted)."""
    class SlowReset(Echo):
        def reset(self, prompt_ids):
            time.sleep(0.2)
            return Echo.reset(self, prompt_ids)

    episodes = run_episodes(engine(), PROMPTS, SlowReset, PARAMS, env_workers=2,
                            env_timeout=0.5)
    assert summary(episodes) == reference_episodes()


def test_calls_queued_behind_hung_ones_still_run():
    """One worker, the first two resets hang for good: each is given up on at env_timeout and
    its thread replaced, so the resets queued behind them run (timed from their start, they
    would otherwise wait for ever, and the run with them)."""
    release = threading.Event()
    made = []

    class Hangs(Echo):
        def reset(self, prompt_ids):
            if len(made) < 2:
                made.append(self)
                release.wait(60)
            return Echo.reset(self, prompt_ids)

    eng = engine()
    try:
        raised = run_or_hang(eng, PROMPTS[:2], Hangs, PARAMS, env_workers=1,
                             env_timeout=0.3)
    finally:
        release.set()
    assert raised is None
    assert_no_kv_held(eng)


@pytest.mark.parametrize("env_timeout", [None, 30.0], ids=["no-timeout", "timeout"])
def test_a_reset_raising_timeouterror_ends_its_episode_with_that_error(env_timeout):
    """A reset's own TimeoutError (a client's) is its error, not env_timeout's: it had been
    taken for one (and without env_timeout its message failed to format)."""
    class OwnTimeout(Echo):
        def reset(self, prompt_ids):
            raise TimeoutError("tool server")

    eng = engine()
    episodes = run_episodes(eng, PROMPTS[:1], OwnTimeout, PARAMS, env_timeout=env_timeout)[0]
    assert [ep.error for ep in episodes] == ["environment reset: TimeoutError: tool server"] * 3
    assert_no_kv_held(eng)


def test_a_prompt_of_max_model_len_minus_one_gets_its_one_token():
    """As generate gives it: the episode's tokens may reach max_model_len."""
    eng = engine(max_model_len=16)
    prompt = TOK.encode("abcdefghijklmno", add_special_tokens=False)[:15]
    assert len(prompt) == 15
    (ep,) = run_episodes(eng, [prompt], Echo, SamplingParams(max_tokens=8, seed=1))[0]
    assert len(ep.token_ids) == 1 and ep.finish_reason in ("done", "length")
    assert_no_kv_held(eng)


def slow_first(coroutine: bool):
    """An environment class whose first instance blocks its first step (a thread, or in an
    async step its event loop) until every other episode has finished."""
    others_done = threading.Event()
    finished = []

    class Slow(Echo):
        instances = []

        def __init__(self):
            super().__init__()
            Slow.instances.append(self)

        def sync_step(self, turn_ids, text):
            if self is Slow.instances[0] and not self.seen:
                assert others_done.wait(timeout=60), "the batch waited for the slow env"
            step = Echo.step(self, turn_ids, text)
            if step.done and self is not Slow.instances[0]:
                finished.append(self)
                if len(finished) == len(Slow.instances) - 1:
                    others_done.set()
            return step

        async def async_step(self, turn_ids, text):
            return self.sync_step(turn_ids, text)

        step = async_step if coroutine else sync_step

    return Slow


def test_a_slow_environment_does_not_stall_the_others():
    """One environment blocks until every other episode has finished: that happens only if
    the batch goes on without it."""
    episodes = run_episodes(engine(), PROMPTS, slow_first(False), PARAMS, max_turns=5)
    assert all(ep.finish_reason == "done" for row in episodes for ep in row)


def test_async_environment():
    class Async(Echo):
        async def step(self, turn_ids, text):
            await asyncio.sleep(0)
            return Echo.step(self, turn_ids, text)

    a = run_episodes(engine(), PROMPTS, Async, PARAMS, max_turns=5)
    b = run_episodes(engine(), PROMPTS, Echo, PARAMS, max_turns=5)
    assert summary(a) == summary(b)


def test_an_async_environment_keeps_one_event_loop():
    """What an async environment makes in reset (a client session, a lock: bound to the loop
    they were made on) serves its steps: they run on the same loop (each call had had a loop
    of its own, and such an environment failed at its first step)."""
    class Bound(Echo):
        async def reset(self, prompt_ids):
            self.lock = asyncio.Lock()
            self.loop = asyncio.get_running_loop()

        async def step(self, turn_ids, text):
            async with self.lock:  # raises on another loop
                assert asyncio.get_running_loop() is self.loop
                return Echo.step(self, turn_ids, text)

    episodes = run_episodes(engine(), PROMPTS, Bound, PARAMS, max_turns=5)
    assert all(ep.finish_reason == "done" for row in episodes for ep in row), \
        [ep.error for row in episodes for ep in row]


@pytest.mark.parametrize("where", ["reset", "step"])
def test_an_async_call_past_env_timeout_is_cancelled_and_ends_its_episode(where):
    """One environment never answers (a hung tool call): with env_timeout its episode ends
    as "abort" saying so, its coroutine cancelled and its KV released; the others finish."""
    cancelled = []

    class Hangs(Echo):
        instances = []

        def __init__(self):
            super().__init__()
            Hangs.instances.append(self)

        async def hang(self):
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                cancelled.append(self)
                raise

        async def reset(self, prompt_ids):
            if where == "reset" and self is Hangs.instances[0]:
                await self.hang()

        async def step(self, turn_ids, text):
            if where == "step" and self is Hangs.instances[0] and self.seen:
                await self.hang()
            return Echo.step(self, turn_ids, text)

    eng = engine()
    episodes = run_episodes(eng, PROMPTS, Hangs, PARAMS, env_timeout=0.5)
    first, *rest = [ep for row in episodes for ep in row]
    assert first.finish_reason == "abort" and f"environment {where}" in first.error
    assert "env_timeout=0.5 s" in first.error
    assert all(ep.finish_reason == "done" for ep in rest)
    assert cancelled == Hangs.instances[:1]
    assert_no_kv_held(eng)


def test_a_thread_past_env_timeout_is_left_to_finish_on_its_own():
    """A synchronous step cannot be cancelled: its episode ends at env_timeout and the run
    returns without waiting for the thread."""
    release, finished = threading.Event(), []

    class Blocks(Echo):
        def step(self, turn_ids, text):
            if not self.seen and self.prompt_ids == TOK.encode(PROMPTS[0]):
                release.wait(60)
                finished.append(self)
            return super().step(turn_ids, text)

    eng = engine()
    episodes = run_episodes(eng, PROMPTS[:1], Blocks, PARAMS, env_timeout=0.5)
    assert [ep.finish_reason for ep in episodes[0]] == ["abort"] * 3
    assert not finished  # returned while the steps still ran
    release.set()
    assert_no_kv_held(eng)
    with pytest.raises(ValueError, match="^env_timeout must be > 0"):
        run_episodes(eng, PROMPTS[:1], Echo, PARAMS, env_timeout=0)
    # (threads are started as calls need them, up to a bound: 2**70 had been a list of that
    # many threads, out of memory)
    with pytest.raises(ValueError, match=r"^env_workers must be in \[1, 1024\]"):
        run_episodes(eng, PROMPTS[:1], Echo, PARAMS, env_workers=2**70)


def test_an_async_environment_that_blocks_stalls_only_its_own_loop():
    """An async step that blocks its loop (a synchronous client inside async code) until
    every other episode is done: that happens only if the others run on loops of their own
    (env_workers of them; all had shared one loop)."""
    episodes = run_episodes(engine(), PROMPTS, slow_first(True), PARAMS, max_turns=5,
                            env_workers=9)
    assert all(ep.finish_reason == "done" for row in episodes for ep in row)


def test_a_hung_synchronous_step_keeps_no_process_alive():
    """A synchronous step that never returns, given up on at env_timeout: the process still
    ends (the pool's threads are daemons; an executor's are joined at exit)."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent("""
        import threading
        from models import char_tokenizer, tiny_model
        from rollout import Engine, EngineConfig, SamplingParams
        from rollout.agent import Step, run_episodes

        class Hangs:
            def step(self, turn_ids, text):
                threading.Event().wait()  # forever
                return Step(done=True)

        tok = char_tokenizer()
        engine = Engine(tiny_model("llama", vocab_size=len(tok)),
                        EngineConfig(kv_cache_tokens=512, max_model_len=64), tokenizer=tok)
        (ep,) = run_episodes(engine, ["ab"], Hangs, SamplingParams(max_tokens=4, seed=0),
                             env_timeout=0.2)[0]
        print(ep.finish_reason)
    """)
    support = os.path.join(os.path.dirname(os.path.dirname(__file__)), "support")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, PYTHONPATH=support))
    assert done.returncode == 0 and done.stdout.strip() == "abort", done.stderr[-2000:]


def test_budgets():
    never = functools.partial(Echo, 100)
    turns = run_episodes(engine(), PROMPTS, never, PARAMS, max_turns=2)
    assert all(ep.finish_reason == "max_turns" and ep.turns == 2 for row in turns for ep in row)
    short = run_episodes(engine(), PROMPTS, never, PARAMS, max_turns=50,
                         max_episode_tokens=40)
    for ep in (ep for row in short for ep in row):
        assert ep.finish_reason == "length" and len(ep.token_ids) <= 40
    with pytest.raises(ValueError, match="max_turns"):
        run_episodes(engine(), PROMPTS, Echo, PARAMS, max_turns=0)


def test_observation_as_ids_and_bad_observations():
    ids = TOK.encode("=7", add_special_tokens=False)
    episodes = run_episodes(engine(), PROMPTS[:1], functools.partial(Echo, 2, ids), PARAMS)
    for ep in episodes[0]:
        at = ep.mask.index(0)
        assert ep.token_ids[at:at + len(ids)] == ids
    bad = run_episodes(engine(), PROMPTS[:1], functools.partial(Echo, 2, [10 ** 6]), PARAMS)
    assert all(ep.finish_reason == "abort" and "vocabulary" in ep.error for ep in bad[0])



@pytest.mark.parametrize("unordered", [set, frozenset, lambda ids: dict.fromkeys(ids).keys()],
                         ids=["set", "frozenset", "dict keys"])
def test_an_unordered_observation_is_refused(unordered):
    """Token ids in an unordered collection have no order to append them in (they were taken
    in the set's iteration order)."""
    ids = unordered(TOK.encode("=7", add_special_tokens=False))
    with pytest.raises(ValueError, match="^observation: .* unordered"):
        Step(observation=ids)
    eng = engine()
    episodes = run_episodes(eng, PROMPTS[:1], functools.partial(Echo, 2, ids), PARAMS)[0]
    assert all(ep.finish_reason == "abort" and "unordered" in ep.error for ep in episodes)
    assert_no_kv_held(eng)

TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}"
            "{% if m['role'] == 'assistant' %}<eos>{% endif %}{{ '\\n' }}{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


def test_chat_message_observation_is_the_templates_delta():
    tok = char_tokenizer("abcdefghijklmnopqrstuvwxyz0123456789 +=.,\n<>/")
    tok.chat_template = TEMPLATE
    delta = message_tokens(tok, {"role": "tool", "content": "42"}, ended_with="<eos>")
    assert tok.decode(delta) == "\n<tool>42\n<assistant>"
    delta = message_tokens(tok, {"role": "tool", "content": "42"}, ended_with=None)
    assert tok.decode(delta) == "<eos>\n<tool>42\n<assistant>"
    # Llama-2's template ends an assistant turn with ' ' + eos: the turn's own end token
    # stands for it (not twice)
    tok.chat_template = ("{% for m in messages %}{% if m.role == 'assistant' %}"
                         "{{ ' ' + m.content + ' <eos>' }}{% else %}{{ '<' + m.role + '>' + "
                         "m.content }}{% endif %}{% endfor %}")
    delta = message_tokens(tok, {"role": "user", "content": "42"}, ended_with="<eos>")
    assert tok.decode(delta) == "<user>42"
    tok.chat_template = "{% for m in messages[-1:] %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(ValueError, match="prefix-preserving"):
        message_tokens(tok, {"role": "tool", "content": "42"}, ended_with="<eos>")


@pytest.mark.parametrize("stops_on", ["eos_ids", "stop_token_ids"])
def test_a_turn_ended_by_an_end_of_turn_id_is_not_ended_twice(stops_on):
    """The model ends its turn with an end-of-turn token that is not the tokenizer's
    eos_token, one of its generation config's end ids (Gemma's <end_of_turn>, Llama-3's
    <|eot_id|>) or, for a base model whose eos is <|endoftext|>, one the caller stops on by
    stop_token_ids: the episode's tokens are still the chat template's rendering of the
    conversation (the template's end-of-turn had been added after the model's own)."""
    tok = char_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<u>", "<a>", "<eot>"]})
    tok.chat_template = ("{% for m in messages %}{% if m.role == 'user' %}<u>{% else %}<a>"
                         "{% endif %}{{ m.content }}<eot>\n{% endfor %}"
                         "{% if add_generation_prompt %}<a>{% endif %}")
    eot = tok.convert_tokens_to_ids("<eot>")
    model = always_picks(tiny_model("llama", vocab_size=len(tok)), eot)  # each turn empty
    if stops_on == "eos_ids":
        model.generation_config.eos_token_id = [tok.eos_token_id, eot]
    eng = Engine(model, EngineConfig(kv_cache_tokens=512, max_model_len=64), tokenizer=tok)

    class User:
        def step(self, turn_ids, text):
            return Step(observation={"role": "user", "content": "hi"})

    conv = [{"role": "user", "content": "ab"}]
    params = SamplingParams(temperature=0, max_tokens=4,
                            stop_token_ids=[eot] if stops_on == "stop_token_ids" else [])
    ep = run_episodes(eng, [conv], User, params, max_turns=2)[0][0]
    assert ep.token_ids[0] == eot  # the rig held
    want = tok.apply_chat_template(conv + [{"role": "assistant", "content": ""},
                                           {"role": "user", "content": "hi"},
                                           {"role": "assistant", "content": ""}],
                                   tokenize=False)
    assert tok.decode(ep.prompt_ids + ep.token_ids) + "\n" == want


class SaysHi:
    """Answers every turn with a user message."""

    def step(self, turn_ids, text):
        return Step(observation={"role": "user", "content": "hi"})


def templated_engine(template: str, on_tokenizer: bool, extra=()) -> tuple:
    """(tokenizer, engine, greedy params stopping at <eot>) over a model whose every turn is
    empty (it always picks <eot>); `template` set as the tokenizer's chat template or not."""
    tok = char_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<u>", "<a>", "<eot>", *extra]})
    if on_tokenizer:
        tok.chat_template = template
    eot = tok.convert_tokens_to_ids("<eot>")
    model = always_picks(tiny_model("llama", vocab_size=len(tok)), eot)
    eng = Engine(model, EngineConfig(kv_cache_tokens=512, max_model_len=64), tokenizer=tok)
    return tok, eng, SamplingParams(temperature=0, max_tokens=4, stop_token_ids=[eot])


CONV = [{"role": "user", "content": "ab"}]


def test_template_options_reach_the_prompts_and_the_observations():
    """chat_template_kwargs (Qwen3's enable_thinking, say) render the prompt and every
    chat-message observation's generation prompt alike: the episode is the template's rendering
    of the conversation with those options. A bad one is refused before anything runs."""
    template = ("{% for m in messages %}{% if m.role == 'user' %}<u>{% else %}<a>"
                "{% endif %}{{ m.content }}<eot>\n{% endfor %}{% if "
                "add_generation_prompt %}<a>{% if not think %}<quiet>{% endif %}{% endif %}")
    tok, eng, params = templated_engine(template, on_tokenizer=True, extra=["<quiet>"])
    ep = run_episodes(eng, [CONV], SaysHi, params, max_turns=2,
                      chat_template_kwargs={"think": False})[0][0]
    want = tok.apply_chat_template(CONV + [{"role": "assistant", "content": "<quiet>"},
                                           {"role": "user", "content": "hi"}],
                                   tokenize=False, add_generation_prompt=True, think=False)
    assert tok.decode(ep.prompt_ids + ep.token_ids) == want + "<eot>"  # the second turn's
    with pytest.raises(ValueError, match="^chat_template_kwargs: 'tokenize'"):
        run_episodes(eng, [CONV], SaysHi, params, chat_template_kwargs={"tokenize": True})
    assert_no_kv_held(eng)


def test_a_template_given_in_chat_template_kwargs_renders_the_observations_too():
    """A tokenizer without a chat template (a base model's), the template passed as
    chat_template_kwargs={"chat_template": ...} (as Engine.chat takes it): the prompts were
    rendered with it, but every chat-message observation was refused ("needs a tokenizer with
    a chat template") and its episode aborted. The episode is the template's rendering."""
    template = ("{% for m in messages %}{% if m.role == 'user' %}<u>{% else %}<a>{% endif %}"
                "{{ m.content }}<eot>\n{% endfor %}{% if add_generation_prompt %}<a>{% endif %}")
    tok, eng, params = templated_engine(template, on_tokenizer=False)
    assert tok.chat_template is None
    ep = run_episodes(eng, [CONV], SaysHi, params, max_turns=2,
                      chat_template_kwargs={"chat_template": template})[0][0]
    assert ep.finish_reason == "max_turns", ep.error
    want = tok.apply_chat_template(CONV + [{"role": "assistant", "content": ""},
                                           {"role": "user", "content": "hi"}],
                                   tokenize=False, add_generation_prompt=True,
                                   chat_template=template)
    assert tok.decode(ep.prompt_ids + ep.token_ids) == want + "<eot>"  # the second turn's
    assert_no_kv_held(eng)


@pytest.mark.parametrize("refusal", ["asleep", "return_routed_experts", "return_support"])
def test_what_add_request_refuses_is_refused_before_any_environment_is_made(refusal):
    """An engine put to sleep (colocation), or what an Episode would silently lack (MoE routes
    for routing replay, the support of each token's draw: it carries tokens, mask and
    logprobs): the run had made every environment and run every reset (a sandbox started per
    episode) before its first turn was refused, or ran without them. Nothing is made, and the
    engine serves afterwards."""
    made = []

    def factory():
        made.append(1)
        return Echo()
    eng = engine()
    params = PARAMS
    if refusal == "asleep":
        eng.sleep()
        raises = pytest.raises(RuntimeError, match="asleep")
    else:
        params = dataclasses.replace(PARAMS, **{refusal: True})
        raises = pytest.raises(ValueError, match=f"^params.{refusal}: an Episode carries")
    with raises:
        run_episodes(eng, PROMPTS, factory, params)
    assert not made
    if refusal == "asleep":
        eng.wake_up()
    assert summary(run_episodes(eng, PROMPTS, Echo, PARAMS)) == reference_episodes()
    assert_no_kv_held(eng)


def test_a_tensor_parallel_engine_is_refused(monkeypatch):
    """Each rank's environments answer in their own order, so the ranks of a tensor-parallel
    engine would disagree on the turns a step admits: refused, naming the field (the config
    alone, as a k-rank engine would hold it: building one needs a world)."""
    eng = engine()
    monkeypatch.setattr(eng, "config", dataclasses.replace(eng.config, tensor_parallel_size=2))
    with pytest.raises(ValueError, match="^tensor_parallel_size: run_episodes runs on one "
                                         "rank's engine, got 2"):
        run_episodes(eng, PROMPTS, Echo, PARAMS)


def test_run_episodes_needs_an_idle_engine():
    eng = engine()
    eng.add_request([1, 2, 3], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="idle"):
        run_episodes(eng, PROMPTS, Echo, PARAMS)


def test_an_engine_with_an_unreturned_output_is_refused_naming_it():
    """run_episodes needs the engine idle: a streaming request that finished inside another
    call's steps waits for step() to return it. The refusal counts it, not only what runs."""
    eng = engine()
    eng.add_request(PROMPTS[0], PARAMS)
    eng.generate(PROMPTS[1:], PARAMS)
    assert eng.running_requests == [] and eng.unreturned_outputs == 1
    with pytest.raises(ValueError, match="0 requests are running and 1 finished ones wait"):
        run_episodes(eng, PROMPTS, Echo, PARAMS, max_turns=2)
    [out] = eng.step()  # nothing was lost: the output is still there to return
    assert out.prompt == PROMPTS[0] and eng.unreturned_outputs == 0
    assert len(run_episodes(eng, PROMPTS, Echo, PARAMS, max_turns=2)) == len(PROMPTS)


@pytest.mark.parametrize("turn", ["first", "later"])
def test_a_turn_aborted_outside_the_run_ends_its_episode(turn, monkeypatch):
    """Engine.abort of one of the run's turns between its steps (a trainer's watchdog thread,
    say: abort drops the output, step() never returns it): the run had waited for that output
    for ever, spinning. The turn's episodes end as "abort" saying so, the others finish as
    they would have, nothing is held, and the engine gives a fresh engine's episodes after."""
    eng = engine()
    victim = "episode-turn-0" if turn == "first" else "episode-turn-3"
    step = Engine.step

    def abort_then_step(self):
        if victim in self.running_requests:
            self.abort(victim)
        return step(self)
    monkeypatch.setattr(Engine, "step", abort_then_step)
    episodes = []
    raised = run_or_hang(eng, PROMPTS, Echo, PARAMS, collect=episodes)
    monkeypatch.undo()
    assert raised is None, raised
    aborted = [(i, j) for i, row in enumerate(episodes) for j, ep in enumerate(row)
               if ep.finish_reason == "abort"]
    # the first turn is one request for all of prompt 0's episodes; turn 3 is one episode's
    assert aborted == [(0, 0), (0, 1), (0, 2)] if turn == "first" else len(aborted) == 1
    for i, j in aborted:
        assert "aborted outside run_episodes" in episodes[i][j].error
    want = reference_episodes()
    assert all(summary([[ep]])[0][0] == want[i][j] for i, row in enumerate(episodes)
               for j, ep in enumerate(row) if (i, j) not in aborted)
    assert_no_kv_held(eng)
    assert summary(run_episodes(eng, PROMPTS, Echo, PARAMS)) == want
    assert_no_kv_held(eng)
