"""update_weights(probe=, probe_reference=): after the copy the engine scores the probe under
the new weights; against the trainer's logprobs of it the gap goes into stats. A stale sync (the
trainer's reference from weights the engine did not get) shows as a large gap; a bad probe is
refused before any weight moves."""

import math

import pytest
import torch
from floors import assert_within_floor, exact_copy, token_logprobs, tolerance
from models import tiny_model

from rollout import Engine, EngineConfig

PROBE = [3, 17, 5, 99, 42, 8, 61, 23, 7, 70, 11, 2]


@torch.no_grad()
def trainer_logprobs(model, tokens):
    """What the trainer computes of the probe: its own float32 forward."""
    logits = model(torch.tensor([tokens])).logits[0, :-1].float()
    return logits.log_softmax(-1).gather(-1, torch.tensor(tokens[1:])[:, None])[:, 0]


@pytest.fixture
def setup():
    a, b = tiny_model("llama", seed=0), tiny_model("llama", seed=1)
    return Engine(a, EngineConfig(kv_cache_tokens=512, max_model_len=64)), a, b


def test_the_probe_agrees_with_the_trainer_after_a_good_sync(setup):
    engine, a, b = setup
    reference = trainer_logprobs(b, PROBE)
    result = engine.update_weights(b, probe=PROBE, probe_reference=reference)  # (a tensor)
    # The floor: the trainer's float32 forward against a float64 one of the same weights.
    exact = trainer_logprobs(b.double(), PROBE).double()
    b.float()
    floor = (reference.double() - exact).abs().max().item()
    assert result["probe_gap"] <= 2 * tolerance(floor, exact)
    assert engine.stats.probe_gap == result["probe_gap"]
    assert len(result["probe_logprobs"]) == len(PROBE) - 1


def test_a_stale_sync_shows_in_the_gap(setup):
    """The trainer's reference is of weights b, the engine was given a (a sync that copied the
    wrong state): the gap is that of two different models."""
    engine, a, b = setup
    reference = trainer_logprobs(b, PROBE)
    result = engine.update_weights(a, probe=PROBE, probe_reference=reference.numpy())
    assert result["probe_gap"] == engine.stats.probe_gap
    assert result["probe_gap"] > 0.1


def test_without_a_reference_the_logprobs_are_recorded(setup):
    engine, a, b = setup
    result = engine.update_weights(b, probe=PROBE)
    assert math.isnan(result["probe_gap"]) and math.isnan(engine.stats.probe_gap)
    got = torch.tensor(result["probe_logprobs"], dtype=torch.float64)
    exact = token_logprobs(exact_copy(b), PROBE[:1], PROBE[1:])
    floor = (trainer_logprobs(b, PROBE).double() - exact).abs()
    assert_within_floor((got - exact).abs(), floor, exact, "probe logprob")
    assert "probe_gap" not in engine.update_weights(a)


@pytest.mark.parametrize("kwargs, match", [
    (dict(probe=[5]), "probe: 1 token; it needs at least 2"),
    (dict(probe=list(range(2, 100))), "probe: 98 tokens, more than max_model_len=64"),
    (dict(probe=True), "probe must be a string or a list of token ids"),
    (dict(probe=PROBE, probe_reference=0.5), "probe_reference must be a list"),
    (dict(probe=[5, 500]), r"token id 500 is outside"),
    (dict(probe="abc"), "a string needs a tokenizer"),
    (dict(probe_reference=[0.1]), "probe_reference needs a probe"),
    (dict(probe=PROBE, probe_reference=[0.1, 0.2]), "probe_reference: 2 logprobs for a probe "
                                                    "of 12 tokens"),
    (dict(probe=PROBE, probe_reference=["x"] * 11), "probe_reference must be a real"),
])
def test_a_bad_probe_is_refused_before_any_weight_moves(setup, kwargs, match):
    engine, a, b = setup
    before = [p.clone() for p in engine.model.parameters()]
    with pytest.raises(ValueError, match=match):
        engine.update_weights(b, **kwargs)
    assert engine.weights_version == 0 and not engine.needs_weights
    assert all(torch.equal(x, y) for x, y in zip(before, engine.model.parameters()))


@pytest.mark.parametrize("error", [None, RuntimeError, KeyboardInterrupt])
def test_the_probe_counts_in_no_score_stat(setup, error, monkeypatch):
    """stats.scored_tokens and score_tokens_computed are Engine.score's: a sync's probe adds to
    neither, also when scoring it fails half way; an Engine.score of the same sequence after
    it counts its own (len - 1 tokens, every position computed)."""
    engine, _, b = setup
    if error is not None:
        step = engine._step_until

        def failing(*args, **kwargs):
            step(*args, **kwargs)  # the probe is computed (counted in the committer), then
            raise error("injected")  # scoring fails before it returns

        monkeypatch.setattr(engine, "_step_until", failing)
        with pytest.raises(error, match="injected"):
            engine.update_weights(b, probe=PROBE)
        monkeypatch.setattr(engine, "_step_until", step)
    else:
        engine.update_weights(b, probe=PROBE)
    assert (engine.stats.scored_tokens, engine.stats.score_tokens_computed) == (0, 0)
    engine.score([PROBE])
    assert (engine.stats.scored_tokens, engine.stats.score_tokens_computed) == (
        len(PROBE) - 1, len(PROBE) - 1)
