"""The measured step cost adaptive speculation weighs drafts against (rollout/spec/cost.py): its
line against a weighted least-squares fit done by numpy over the same steps; unknown until the
steps can tell the fixed part from the per-position one; and the draft lengths it leads to in
an engine, on a machine whose steps cost in proportion to their positions (a CPU) and on one
whose steps cost alike whatever their size (a GPU at rollout batch sizes), outputs unchanged."""

import numpy as np
import pytest
from helpers import pin_step_cost
from models import tiny_model

from rollout import Engine, EngineConfig, SamplingParams, SpeculativeConfig
from rollout.spec.cost import DECAY, MIN_STEPS, StepCost


def numpy_line(positions, seconds):
    """(fixed, per position) by weighted least squares, weights DECAY ** age."""
    w = DECAY ** np.arange(len(positions))[::-1]
    design = np.stack([np.ones(len(positions)), np.asarray(positions, float)], axis=1)
    sw = np.sqrt(w)
    (fixed, per_position), *_ = np.linalg.lstsq(design * sw[:, None],
                                                np.asarray(seconds) * sw, rcond=None)
    return fixed, per_position


@pytest.mark.parametrize("seed", range(4))
def test_line_is_the_weighted_least_squares_fit(seed):
    rng = np.random.default_rng(seed)
    positions = rng.integers(1, 300, size=200)
    seconds = 0.012 + 0.0013 * positions + rng.normal(0, 0.002, size=200)
    cost = StepCost()
    for p, s in zip(positions, seconds):
        cost.observe(int(p), float(s))
    fixed, per_position = cost.line()
    ref_fixed, ref_per_position = numpy_line(positions, seconds)
    assert fixed == pytest.approx(ref_fixed, rel=1e-6, abs=1e-9)
    assert per_position == pytest.approx(ref_per_position, rel=1e-6)
    assert cost.bar(16) == pytest.approx(per_position * 16 / (fixed + per_position * 16))


def test_follows_the_machine_and_forgets_the_old_mix():
    rng = np.random.default_rng(0)
    cost = StepCost()
    for p in rng.integers(1, 300, size=400):
        cost.observe(int(p), 0.010 + 0.002 * p)
    for p in rng.integers(1, 300, size=400):  # the batch mix and the machine changed
        cost.observe(int(p), 0.005 + 0.0005 * p)
    fixed, per_position = cost.line()  # the old mix weighs DECAY ** 400 ~ 3e-4
    assert fixed == pytest.approx(0.005, rel=1e-2) and per_position == pytest.approx(0.0005,
                                                                                     rel=1e-2)


def test_unknown_until_the_steps_tell_the_parts_apart():
    cost = StepCost()
    for p in range(1, MIN_STEPS):
        cost.observe(p * 10, 0.01 * p)
    assert cost.line() is None and cost.bar(4) is None  # too few steps
    steady = StepCost()
    for _ in range(50):
        steady.observe(64, 0.1)  # one batch size only: fixed and per position inseparable
    assert steady.line() is None
    steady.observe(0, 0.1)  # nothing computed: not a step to learn from
    steady.observe(64, float("nan"))
    assert steady.steps == 50
    flat = StepCost()  # a GPU's steps at rollout sizes: the same time whatever the positions
    for p in range(1, 40):
        flat.observe(p * 8, 0.007 - 1e-6 * p)
    assert flat.line() == (pytest.approx(0.007, rel=0.01), 0.0)
    assert flat.bar(32) == 0.0


def engine_with_cost(model, fixed, per_position):
    """An adaptive n-gram engine whose step cost is the given machine's, held fixed."""
    return pin_step_cost(Engine(model, EngineConfig(
        kv_cache_tokens=4096, max_model_len=160,
        speculative=SpeculativeConfig("ngram", num_speculative_tokens=6, adaptive=True))),
        fixed, per_position)


def test_draft_lengths_follow_the_machine():
    """Repetitive prompts, so n-gram drafts are mostly kept: on a machine whose steps cost
    alike at any size the engine drafts the whole budget; where every position costs what a
    decoded token does it drafts what it nearly always keeps, far less; same tokens as no
    speculation; the fitted line is in the stats."""
    model = tiny_model("qwen2", seed=3)
    prompts = [[5, 6, 7, 8] * 6, [9, 10, 11] * 8]
    params = SamplingParams(n=4, max_tokens=48, temperature=0, ignore_eos=True)
    plain = Engine(model, EngineConfig(kv_cache_tokens=4096, max_model_len=160))
    expected = [[s.token_ids for s in o.samples] for o in plain.generate(prompts, params)]
    flat = engine_with_cost(model, 0.007, 0.0)
    proportional = engine_with_cost(model, 0.0, 0.001)
    per_verification = {}
    for name, engine in (("flat", flat), ("proportional", proportional)):
        got = [[s.token_ids for s in o.samples] for o in engine.generate(prompts, params)]
        assert got == expected, name
        stats = engine.stats
        assert stats.spec_verifications > 0
        per_verification[name] = stats.spec_proposed / stats.spec_verifications
    assert per_verification["flat"] > 2 * per_verification["proportional"]
    assert per_verification["proportional"] < 2.5
    assert flat.stats.spec_position_seconds == 0.0
    assert proportional.stats.spec_position_seconds == pytest.approx(0.001)


def test_drafts_that_shape_outputs_do_not_follow_the_clock():
    """Rejection acceptance of a draft model's proposals: the emitted tokens depend on the
    drafts, so adaptive drafting must not weigh them against the measured step cost (the
    machine, its load). It weighs them against the batch's share of max_batch_size, as when no
    cost is known yet: the same proposals and samples on a CPU-like and a GPU-like machine
    (they once differed) as with no step ever measured."""
    model, draft = tiny_model("qwen2"), tiny_model("qwen2", seed=3, num_hidden_layers=1)
    prompts = [[5, 6, 7, 8] * 6, [9, 10, 11] * 8, [1, 2, 3]]
    params = SamplingParams(n=3, max_tokens=40, temperature=1.0, seed=4, ignore_eos=True)

    def run(cost):
        engine = Engine(model, EngineConfig(kv_cache_tokens=4096, max_model_len=160,
                                            speculative=SpeculativeConfig(
                                                "draft", num_speculative_tokens=6, adaptive=True,
                                                draft_model=draft, acceptance="rejection")))
        if cost is None:
            engine.speculator.observe_step = lambda positions, seconds: None
        else:
            pin_step_cost(engine, *cost)
        got = [[s.token_ids for s in o.samples] for o in engine.generate(prompts, params)]
        return got, engine.stats.spec_proposed

    unmeasured = run(None)
    assert run((0.0, 0.001)) == unmeasured  # steps cost in proportion to their positions
    assert run((0.007, 0.0)) == unmeasured  # steps cost alike whatever their size
    assert unmeasured[1] > 0


def test_a_draft_model_drafts_no_more_than_pays():
    """Adaptive drafting with a draft model: every token the draft model proposes costs a
    forward of its own, so it is asked only for what pays, not for k tokens to be cut after
    (on a CPU-like machine it drafted 366 tokens for 65 verified). Counted naively: the tokens
    its proposals held against the draft tokens the target verified; outputs as without
    speculation."""
    model, draft = tiny_model("qwen2"), tiny_model("qwen2", seed=3, num_hidden_layers=1)
    prompts = [[5, 6, 7, 8] * 6, [9, 10, 11] * 8, [1, 2, 3]]
    params = SamplingParams(n=3, max_tokens=40, temperature=1.0, seed=4, ignore_eos=True)
    plain = Engine(model, EngineConfig(kv_cache_tokens=4096, max_model_len=160))
    expected = [[s.token_ids for s in o.samples] for o in plain.generate(prompts, params)]
    engine = pin_step_cost(Engine(model, EngineConfig(
        kv_cache_tokens=4096, max_model_len=160, speculative=SpeculativeConfig(
            "draft", num_speculative_tokens=6, adaptive=True, draft_model=draft))), 0.0, 0.001)
    drafter = engine.speculator.drafter
    drafted = []

    def counted(wanted, siblings, propose=drafter.propose_batch):
        proposals = propose(wanted, siblings)
        drafted.extend(len(tokens) for tokens, _ in proposals)
        return proposals
    drafter.propose_batch = counted
    got = [[s.token_ids for s in o.samples] for o in engine.generate(prompts, params)]
    assert got == expected
    stats = engine.stats
    assert stats.spec_verifications > 0
    assert stats.spec_proposed < 2 * stats.spec_verifications  # what pays here: ~1 a sample
    assert sum(drafted) == stats.spec_proposed


def test_the_stats_show_the_line_only_while_it_is_known():
    """engine.stats' spec_step_fixed_seconds / spec_position_seconds are the line adaptive
    drafting uses, nan while it is unknown: after a run of equal-size steps the line is
    forgotten (the drafts go by the batch-share bar), and the stats had kept the old one."""
    engine = Engine(tiny_model("llama"), EngineConfig(
        kv_cache_tokens=512, max_model_len=64,
        speculative=SpeculativeConfig("ngram", num_speculative_tokens=4, adaptive=True)))
    cost = engine.speculator.cost
    for p in range(1, 40):
        cost.observe(p, 0.01 + 0.001 * p)
    stats = engine.stats
    assert (stats.spec_step_fixed_seconds, stats.spec_position_seconds) == pytest.approx(
        numpy_line(range(1, 40), [0.01 + 0.001 * p for p in range(1, 40)]))
    for _ in range(500):
        cost.observe(64, 0.1)
    assert cost.line() is None
    stats = engine.stats
    assert np.isnan(stats.spec_step_fixed_seconds) and np.isnan(stats.spec_position_seconds)
