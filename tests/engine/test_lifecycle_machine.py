"""The engine's calls in any order: rollout (groups, over-sampling, abort_rest), generate,
streaming add_request/step, multi-turn episodes (K/V held, later turns resuming on it), abort,
sleep at both levels, wake_up and update_weights with the same or other weights, Engine.score,
the draft history cleared, a refused call, and faults at each point those calls reach, under
every drafter, both carried_kv modes, each staleness policy and an unmerged LoRA adapter (a
Hypothesis state machine).

The reference is independent of the engine's lifecycle: in the batch-invariant mode a token's
row is the same bits whatever batch or step computed it, so every token a sample got under
weights version v, from position a on, is what a reference engine holding those weights (plain,
no prefix cache, no carried state) draws given
prompt + the sample's tokens before a (the same seed and sample index: the noise is a function of
seed, position and token), with the same logprobs, bit for bit. After every call the engine's
invariants hold; at the end every group it took has been returned once, aborted or dropped, and
every slot is free or cached unlocked.
"""

from __future__ import annotations

import functools

import pytest
from hypothesis import HealthCheck, Phase, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, invariant, precondition, rule,
                                 run_state_machine_as_test)
from lora_models import lora_config, randomise_b
from models import tiny_model
from test_carry import CARRY_POINTS, other_weights
from test_faults import PROMPTS, SLEEP_POINTS, STEP_POINTS, TOK, WAKE_POINTS, Fault, make, target
from test_suffix_faults import POINTS as HISTORY_POINTS

from rollout import SamplingParams

# Seeded sampling (whole, top-p, top-k) and greedy; lengths such that a 64-slot pool preempts.
PARAMS = [SamplingParams(n=2, temperature=1.0, seed=11, max_tokens=12, logprobs=True),
          SamplingParams(n=3, temperature=0.8, seed=5, max_tokens=9, logprobs=True, top_p=0.8),
          SamplingParams(n=1, temperature=1.2, seed=2, max_tokens=16, logprobs=True, top_k=4),
          SamplingParams(n=2, temperature=0, max_tokens=10, logprobs=True)]


@functools.cache
def adapter(seed: int):
    """target()'s base (a fresh copy: PEFT wraps it in place) with a LoRA adapter of its own,
    served unmerged: updates between two of them copy the adapters only."""
    import peft

    model = peft.get_peft_model(tiny_model("qwen2", vocab_size=len(TOK)), lora_config("qwen2"))
    randomise_b(model, seed)
    return model.eval()


# The weights an engine starts with ("target") and an update brings ("target" again or "other"):
# whole models, or adapters on one base for configurations that serve LoRA.
WEIGHTS = {"target": target, "other": other_weights,
           "adapter": lambda: adapter(1), "adapter2": lambda: adapter(2)}
AS_LORA = {"target": "adapter", "other": "adapter2"}
# A later turn: the environment's answer appended to a held sample, a short reply sampled.
OBSERVATION = TOK.encode(" ok.")
TURN = SamplingParams(n=1, temperature=1.0, seed=3, max_tokens=4, logprobs=True)
PICK = st.tuples(st.integers(0, len(PROMPTS) - 1), st.integers(0, len(PARAMS) - 1))
# Calls a fault may hit, and their arguments.
CALLS = {
    "rollout": st.fixed_dictionaries({"picks": st.lists(PICK, max_size=3),
                                      "share": st.floats(0, 1), "abort_rest": st.booleans()}),
    "generate": st.fixed_dictionaries({"picks": st.lists(PICK, min_size=1, max_size=2)}),
    "stream": st.fixed_dictionaries({"pick": PICK, "steps": st.integers(1, 4),
                                     "hold": st.booleans()}),
    "sleep_and_wake": st.fixed_dictionaries({"level": st.sampled_from([1, 2]),
                                             "weights": st.sampled_from(list(AS_LORA))}),
    "update_awake": st.fixed_dictionaries({"weights": st.sampled_from(list(AS_LORA))}),
}
# Where a fault may strike (what holds the method and its name, given the engine) and the calls
# that reach it: the points the other fault tests strike one at a time (a step's, sleep's and
# wake-up's: test_faults.py; carrying groups: test_carry.py; the history and adaptive rates:
# test_suffix_faults.py), and the stale K/V kept at an update with carried_kv="park" (which
# test_carry_park.py strikes inline). Points an engine lacks (no drafter, no parking) are left
# out.
STEPS = ("rollout", "generate", "stream")
COLOCATION = ("sleep_and_wake", "update_awake")
POINTS = {
    # (a failing tokenizer fails its own request, not the call: test_faults.py)
    **{name: (where, STEPS) for name, (where, _, _) in STEP_POINTS.items() if name != "tokenizer"},
    **{name: (where, ("sleep_and_wake",))
       for name, (where, _) in {**SLEEP_POINTS, **WAKE_POINTS}.items()},
    **{name: (where, ("rollout",) + COLOCATION) for name, (where, _) in CARRY_POINTS.items()},
    **{name: (where, STEPS) for name, where in HISTORY_POINTS.items()},
    "keep_stale": (lambda e: (e.kv, "keep_stale"), COLOCATION),
    "tag_branches": (lambda e: (e.cache, "tag_branches"), COLOCATION),
}


@functools.cache
def reference(weights: str):
    """A plain engine (no drafter, no carry, no prefix cache) holding `weights`."""
    return make("plain", False, WEIGHTS[weights](), batch_invariant=True)


def expected(weights: str, context: list[int], params: SamplingParams, index: int,
             max_tokens: int):
    """Sample `index` of `params` drawn from `context` by the reference engine on `weights`."""
    again = SamplingParams(n=index + 1, temperature=params.temperature, top_p=params.top_p,
                           top_k=params.top_k, seed=params.seed, max_tokens=max_tokens,
                           logprobs=True)
    return reference(weights).generate([context], again)[0].samples[index]


def runs(versions: list[int]) -> list[tuple[int, int, int]]:
    """Maximal runs (start, end, version) of equal versions."""
    out, start = [], 0
    for i in range(1, len(versions) + 1):
        if i == len(versions) or versions[i] != versions[start]:
            out.append((start, i, versions[start]))
            start = i
    return out


# (drafter, carried_kv, max_staleness, stale_groups, weights): each drafter once, each
# staleness policy where an update finds carried tokens one version old, LoRA served unmerged.
CONFIGS = [("plain", "recompute", 0, "restart", "model"),
           ("ngram", "recompute", 0, "drop", "model"),
           ("suffix", "park", None, "restart", "model"),
           ("draft", "recompute", 0, "keep", "model"),
           ("draft", "recompute", 0, "restart", "model"),
           ("ngram", "park", 1, "restart", "model"),
           ("suffix", "recompute", 1, "drop", "lora")]


class Lifecycle(RuleBasedStateMachine):
    config = CONFIGS[0]

    def __init__(self) -> None:
        super().__init__()
        spec, carried_kv, max_staleness, policy, weights = self.config
        self.names = AS_LORA if weights == "lora" else {}
        self.engine = make(spec, True, WEIGHTS[self.names.get("target", "target")](),
                           batch_invariant=True, max_staleness=max_staleness,
                           stale_groups=policy, carried_kv=carried_kv)
        if self.names:
            assert self.engine.lora_status == "unmerged"
        self.park = carried_kv == "park"
        self.max_staleness = None if policy == "keep" else max_staleness
        self.unenforced = False  # an update raised after its weights went in
        self.points = {}
        for point, (where, calls) in POINTS.items():
            try:
                obj, name = where(self.engine)
            except AttributeError:  # e.g. no drafter
                continue
            if callable(getattr(obj, name, None)):
                self.points[point] = (obj, name, calls)
        self.versions = [self.names.get("target", "target")]  # version -> the weights it holds
        self.bringing = self.versions[0]  # the weights the last update_weights brought
        # Request ids count up from 0 in the order requests are made (a refused call makes
        # none; Engine.score makes one a sequence): request id -> its params.
        self.next_id = 0
        self.params_of: dict[str, SamplingParams] = {}
        self.returned: set[str] = set()
        self.aborted: set[str] = set()
        self.samples = []  # (prompt ids, params, sample) of every sample returned
        self.hold_kv: set[str] = set()  # streaming requests whose samples hold their K/V
        # hold key -> its tokens, the weights version they ended under
        self.held: dict[tuple[str, int], tuple[list[int], int]] = {}

    # --- what the engine returns is checked against the reference ----------------------------
    def check(self, outs) -> None:
        for out in outs:
            assert out.request_id not in self.returned | self.aborted, out.request_id
            self.returned.add(out.request_id)
            params = self.params_of[out.request_id]
            assert len(out.samples) == params.n
            for j, s in enumerate(out.samples):
                self.samples.append((out.prompt_token_ids, params, s))
                if out.request_id in self.hold_kv and s.finish_reason != "abort":
                    self.held[(out.request_id, j)] = (out.prompt_token_ids + s.token_ids,
                                                      self.engine.weights_version)
                assert s.index == j and len(s.weights_versions) == len(s.token_ids)
                assert s.weights_versions == sorted(s.weights_versions)
                if self.max_staleness is not None and s.token_ids and not self.unenforced:
                    assert s.weights_versions[-1] - s.weights_versions[0] <= self.max_staleness
                event(f"a sample's runs of one weights version: {len(runs(s.weights_versions))}")
                for start, end, version in runs(s.weights_versions):
                    last = end == len(s.token_ids)
                    want = expected(self.versions[version],
                                    out.prompt_token_ids + s.token_ids[:start], params, j,
                                    params.max_tokens - start)
                    n = end - start
                    assert s.token_ids[start:end] == want.token_ids[:n]
                    assert s.logprobs[start:end] == want.logprobs[:n]
                    assert s.sampling_logprobs[start:end] == want.sampling_logprobs[:n]
                    if last:
                        assert len(want.token_ids) == n
                        assert s.finish_reason == want.finish_reason

    def new_requests(self, picks: list[tuple[int, int]]):
        """Prompts and params of `picks`, and the ids the engine will give them."""
        ids = [str(self.next_id + i) for i in range(len(picks))]
        self.next_id += len(picks)
        self.params_of.update({rid: PARAMS[q] for rid, (_, q) in zip(ids, picks)})
        return [PROMPTS[p] for p, _ in picks], [PARAMS[q] for _, q in picks], ids

    # --- rules --------------------------------------------------------------------------------
    @rule(args=CALLS["rollout"])
    def rollout_rule(self, args):
        self.rollout(**args)

    def rollout(self, picks, share, abort_rest):
        prompts, params, ids = self.new_requests(picks)
        carried = self.engine.carried
        groups = round(share * (len(carried) + len(prompts)))
        outs = self.engine.rollout(prompts, params, groups=groups, abort_rest=abort_rest)
        assert len(outs) == groups
        ages = [int(o.request_id) for o in outs]
        assert ages == sorted(ages), "complete groups come oldest first"
        self.check(outs)
        handed = {o.request_id for o in outs}
        if abort_rest:
            assert not self.engine.carried
            self.aborted |= set(carried + ids) - handed
        else:
            assert set(self.engine.carried) | handed == set(carried + ids)

    @rule(args=CALLS["generate"])
    def generate_rule(self, args):
        self.generate(**args)

    def generate(self, picks):
        prompts, params, ids = self.new_requests(picks)
        carried = self.engine.carried
        outs = self.engine.generate(prompts, params)
        assert [o.request_id for o in outs] == ids
        assert all(s.finish_reason in ("stop", "length") for o in outs for s in o.samples)
        self.check(outs)
        assert self.engine.carried == carried

    @rule(args=CALLS["stream"])
    def stream_rule(self, args):
        self.stream(**args)

    def stream(self, pick, steps, hold):
        """A streaming request (add_request, its samples' K/V held for a next turn or not),
        then a few step()s."""
        [prompt], [params], [rid] = self.new_requests([pick])
        assert self.engine.add_request(prompt, params, hold_kv=hold) == rid
        if hold:
            self.hold_kv.add(rid)
        self.steps(steps)

    def steps(self, count: int) -> None:
        for _ in range(count):
            self.check(self.engine.step())

    @rule(pick=PICK)
    def first_turn(self, pick):
        """An episode's first turn, its K/V held, stepped until every streaming request has
        finished and been returned."""
        self.stream(pick, 0, True)
        while self.engine.has_unfinished:
            self.check(self.engine.step())

    @precondition(lambda self: self.held)
    @rule(data=st.data(), hold=st.booleans(), steps=st.integers(0, 4))
    def next_turn(self, data, hold, steps):
        """A later turn of a held sample (add_request(resume=key)): its context and an
        observation as the prompt, the held K/V reused where it still stands, whatever
        sleeps and updates came between (old weights' K/V must not be)."""
        key = data.draw(st.sampled_from(sorted(self.held)))
        tokens, version = self.held.pop(key)
        context = tokens + OBSERVATION
        event(f"a next turn across an update: {version != self.engine.weights_version}")
        if len(context) + TURN.max_tokens > 40:  # past max_model_len
            assert self.engine.release_hold(key) in (True, False)
            return
        rid = str(self.next_id)
        self.next_id += 1
        self.params_of[rid] = TURN
        assert self.engine.add_request(context, TURN, hold_kv=hold, resume=key) == rid
        if hold:
            self.hold_kv.add(rid)
        self.steps(steps)

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def end_episode(self, data):
        key = data.draw(st.sampled_from(sorted(self.held)))
        del self.held[key]
        assert self.engine.release_hold(key) in (True, False)  # False: dropped under pressure

    @rule(args=CALLS["sleep_and_wake"])
    def sleep_and_wake_rule(self, args):
        self.sleep_and_wake(**args)

    def sleep_and_wake(self, level, weights):
        self.engine.sleep(level)
        self.engine.check_invariants()
        self.engine.wake_up()
        if level == 2:
            self.update(weights)

    @rule(args=CALLS["update_awake"])
    def update_awake(self, args):
        self.update(args["weights"])

    @rule(data=st.data(), kind=st.sampled_from([RuntimeError, KeyboardInterrupt]),
          at=st.integers(1, 3), after=st.booleans())
    def faulted(self, data, kind, at, after):
        """A fault at the `at`-th call of a point during one call: the call raises (unless it
        never got that far), the engine's invariants hold, and whatever it returns later is
        still the reference's."""
        point = data.draw(st.sampled_from(sorted(self.points)))
        obj, name, calls = self.points[point]
        call = data.draw(st.sampled_from(calls))
        args = data.draw(CALLS[call])
        made = self.next_id
        fault = Fault(kind, at, after)
        own = name in vars(obj)
        original = getattr(obj, name)
        setattr(obj, name, fault.wrap(original))
        try:
            if call == "update_awake":
                self.update(**args)
            else:
                getattr(self, call)(**args)
        except kind as e:
            assert "injected" in str(e)
            event(f"fault at {point} in {call}")
            self.recover(call, made)
        finally:
            if own:
                setattr(obj, name, original)
            else:
                delattr(obj, name)
        self.engine.check_invariants()

    @precondition(lambda self: self.engine.carried)
    @rule(data=st.data())
    def abort_carried(self, data):
        rid = data.draw(st.sampled_from(self.engine.carried))
        self.engine.abort(rid)
        self.aborted.add(rid)
        assert rid not in self.engine.carried

    @precondition(lambda self: self.samples)
    @rule(data=st.data())
    def score(self, data):
        """Engine.score of prompt + a returned sample's tokens under the weights it was sampled
        with (the engine's now) gives its logprobs, bit for bit, whatever is carried or cached
        (parked K/V of other weights included)."""
        now = self.versions[-1]
        same = [(p, sp, s) for p, sp, s in self.samples if s.token_ids
                and all(self.versions[v] == now for v in s.weights_versions)]
        if not same:
            return
        prompt, params, sample = data.draw(st.sampled_from(same))
        [got] = self.engine.score([prompt + sample.token_ids], start=len(prompt),
                                  temperature=params.temperature or 1.0)
        self.next_id += 1
        assert got.logprobs == sample.logprobs
        event("scored")

    @rule()
    def clear_history(self):
        self.engine.clear_draft_history()

    @rule(share=st.floats(0, 1))
    def too_many_groups(self, share):
        """A bad call changes nothing."""
        carried = self.engine.carried
        with pytest.raises(ValueError, match="groups"):
            self.engine.rollout([PROMPTS[0]], PARAMS[0], groups=len(carried) + 2)
        assert self.engine.carried == carried

    @invariant()
    def consistent(self):
        self.engine.check_invariants()

    def teardown(self):
        """Everything left runs to the end and the episodes end: each group made is returned
        once, aborted or dropped as stale, and nothing holds a slot."""
        engine = self.engine
        self.check(engine.rollout())
        while engine.has_unfinished:
            self.check(engine.step())
        assert not engine.carried
        for key in self.held:  # the episodes end
            engine.release_hold(key)
        lost = set(self.params_of) - self.returned - self.aborted
        assert len(lost) == engine.stats.stale_drops
        assert self.returned.isdisjoint(self.aborted)
        assert engine.inspect().kv_available == engine.inspect().kv_slots
        engine.check_invariants()
        for name in ("retracted", "preemptions", "stale_restarts", "stale_drops",
                     "parked_tokens", "spec_accepted"):
            event(f"{name} > 0: {getattr(engine.stats, name, 0) > 0}")

    # --- helpers ------------------------------------------------------------------------------
    def update(self, weights: str) -> None:
        if self.park:
            weights = "target"  # parked K/V is the old weights': only same-weights updates
        weights = self.names.get(weights, weights)
        self.bringing = weights
        self.engine.update_weights(WEIGHTS[weights]())
        self.versions.append(weights)
        assert self.engine.weights_version == len(self.versions) - 1
        self.unenforced = False  # every group still out is within max_staleness again

    def recover(self, call: str, made: int) -> None:
        """After a call that raised: a generate()'s requests were abandoned; an update that
        got its weights in counts as a version (staleness may not have been enforced); the
        engine is woken and its weights refilled if the call left it so."""
        if call == "generate":
            self.aborted |= {str(i) for i in range(made, self.next_id)}
        engine = self.engine
        if len(self.versions) <= engine.weights_version:
            self.versions.append(self.bringing)
            self.unenforced = True
        assert engine.weights_version == len(self.versions) - 1
        if engine.is_sleeping:
            engine.wake_up()
        if engine.needs_weights:
            self.update(self.bringing)


@pytest.mark.parametrize("config", CONFIGS, ids=["-".join(map(str, c)) for c in CONFIGS])
def test_any_order_of_calls_matches_the_reference(config):
    """20 runs of up to 20 calls each (about 15 s a configuration on one core of an AMD EPYC
    Zen 3; 30 runs took 17-33 s, the suite's longest engine file)."""
    machine = type("Lifecycle", (Lifecycle,), {"config": config})
    # No shrinking: a failing run of up to 20 calls is printed as it ran (shrinking one took
    # Hypothesis more than five minutes of engine runs).
    run_state_machine_as_test(machine, settings=settings(
        max_examples=20, stateful_step_count=20, deadline=None, derandomize=True,
        phases=[Phase.explicit, Phase.reuse, Phase.generate],
        suppress_health_check=[HealthCheck.too_slow]))
