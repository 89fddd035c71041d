"""EngineStats accounts for a step's time by phase: the parts never exceed the whole."""

from models import tiny_model

from rollout import Engine, EngineConfig, SamplingParams
from rollout.engine.stats import STEP_PHASES as PHASES
from rollout.spec import SpeculativeConfig


def test_step_time_splits_into_phases():
    for spec in (None, SpeculativeConfig("ngram", num_speculative_tokens=3)):
        engine = Engine(tiny_model("qwen2"), EngineConfig(kv_cache_tokens=1024,
                                                          max_model_len=64, speculative=spec))
        engine.generate([[1, 2, 3, 1, 2, 3, 1, 2], [4, 5, 6]],
                        SamplingParams(n=3, max_tokens=12, temperature=0))
        stats = engine.stats.as_dict()
        parts = [stats[name] for name in PHASES]
        assert all(p >= 0 for p in parts), dict(zip(PHASES, parts))
        assert stats["forward_seconds"] > 0 and stats["commit_seconds"] > 0
        assert sum(parts) <= stats["step_seconds"] + 1e-9
        assert stats["steps"] > 10
