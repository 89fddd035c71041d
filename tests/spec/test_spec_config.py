"""SpeculativeConfig as the engine takes it: checked again when the engine is built (fields can
be set after construction, as SamplingParams' are), and the engine's own copy, so a caller's
later edits reach no running engine."""

import pytest
from models import tiny_model

from rollout import Engine, EngineConfig, SamplingParams, SpeculativeConfig

# A field set after construction to a value the constructor refuses.
EDITS = [("method", "suffx"), ("acceptance", "Rejection"), ("num_speculative_tokens", 100),
         ("num_speculative_tokens", 0), ("ngram_min", 0), ("history_min_share", 0.0),
         ("history_max_match", 100_000), ("adaptive", "yes"), ("max_batch_size", -1)]


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen2")


def build(model, spec: SpeculativeConfig) -> Engine:
    return Engine(model, EngineConfig(kv_cache_tokens=512, max_model_len=64, speculative=spec))


@pytest.mark.parametrize("field, value", EDITS)
def test_a_field_set_after_construction_is_checked(model, field, value):
    """The engine refuses what the constructor refuses, with its message (a method misspelt
    this way had run n-gram drafting, an acceptance 'Rejection' the coupled rule, 100 draft
    tokens past the limit of 16)."""
    with pytest.raises(ValueError) as refused:
        SpeculativeConfig(**{"method": "suffix", field: value})
    spec = SpeculativeConfig("suffix")
    setattr(spec, field, value)
    with pytest.raises(ValueError, match=f"speculative.{field}") as built:
        build(model, spec)
    assert str(built.value) == str(refused.value)


def test_later_edits_reach_no_running_engine(model):
    """What the engine drafts with is what it was built with: edits of the caller's config
    afterwards change nothing (drafts of up to 4 tokens go on after setting 1)."""
    spec = SpeculativeConfig("ngram", num_speculative_tokens=4)
    engine = build(model, spec)
    spec.num_speculative_tokens, spec.method = 1, "suffix"
    engine.generate([[1, 2, 3] * 5], SamplingParams(temperature=0, max_tokens=30))
    stats = engine.stats
    assert stats.spec_proposed > stats.spec_verifications  # some drafts were longer than 1
    assert set(stats.spec_sources) == {"ngram"}
