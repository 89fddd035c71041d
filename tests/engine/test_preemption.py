"""A pool too small for the batch preempts, and outputs do not change."""

import random

import pytest
from helpers import run_checked, samples
from models import tiny_model

from rollout import Engine, EngineConfig, SamplingParams


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=40),
    SamplingParams(n=3, temperature=1.0, top_p=0.9, max_tokens=40, seed=11),
])
def test_small_pool_preempts_and_matches_large_pool(params):
    rng = random.Random(0)
    prompts = [[rng.randrange(128) for _ in range(rng.randrange(5, 30))] for _ in range(8)]
    model = tiny_model("qwen2")
    big = Engine(model, EngineConfig(kv_cache_tokens=8192, max_model_len=80))
    small = Engine(model, EngineConfig(kv_cache_tokens=120, max_model_len=80))
    a = run_checked(big, prompts, params)
    b = run_checked(small, prompts, params)
    assert small.stats.preemptions > 0
    assert big.stats.preemptions == 0
    assert samples(a) == samples(b)


def test_preempted_sequences_reuse_their_cached_tokens():
    prompts = [list(range(1, 40)), list(range(40, 79)), list(range(79, 118))]
    engine = Engine(tiny_model("llama"), EngineConfig(kv_cache_tokens=130, max_model_len=100))
    run_checked(engine, prompts, SamplingParams(temperature=0, max_tokens=50))
    stats = engine.stats
    assert stats.preemptions > 0
    assert stats.cache_hit_tokens > 0
