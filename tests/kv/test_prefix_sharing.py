"""Prompt KV computed once: n samples, repeated prompts and shared system prefixes."""

import random

from helpers import run_checked, samples
from models import tiny_model

from rollout import Engine, EngineConfig, SamplingParams


def grpo_prompts(num_prompts=16, prefix_len=128, prompt_len=192, vocab=128, seed=0):
    rng = random.Random(seed)
    system = [rng.randrange(vocab) for _ in range(prefix_len)]
    return [system + [rng.randrange(vocab) for _ in range(prompt_len - prefix_len)]
            for _ in range(num_prompts)], prefix_len


def test_shared_prefix_and_n_samples_compute_each_prompt_token_once():
    prompts, prefix = grpo_prompts()
    n = 8
    engine = Engine(tiny_model("qwen2"), EngineConfig(kv_cache_tokens=16384, max_model_len=512))
    outs = run_checked(engine, prompts, SamplingParams(n=n, temperature=1.0, max_tokens=8, seed=1))
    unique = prefix + sum(len(p) - prefix for p in prompts)
    requests = len(prompts) * n
    stats = engine.stats
    assert stats.prompt_tokens == sum(len(p) for p in prompts) * n
    assert unique <= stats.prompt_tokens_computed <= unique + requests
    assert all(len(o.samples) == n for o in outs)


def test_identical_prompts_sent_separately_share_their_kv():
    # TRL repeats every prompt num_generations times as separate requests.
    rng = random.Random(1)
    distinct = [[rng.randrange(128) for _ in range(40)] for _ in range(4)]
    prompts = [p for p in distinct for _ in range(6)]
    engine = Engine(tiny_model("llama"), EngineConfig(kv_cache_tokens=4096, max_model_len=128))
    outs = run_checked(engine, prompts, SamplingParams(temperature=0, max_tokens=5))
    unique = sum(len(p) for p in distinct)
    assert engine.stats.prompt_tokens_computed <= unique + len(prompts)
    # Identical greedy prompts give identical outputs.
    for k in range(4):
        group = samples(outs[6 * k:6 * k + 6])
        assert all(g == group[0] for g in group)


def test_finished_requests_stay_cached_until_evicted():
    engine = Engine(tiny_model("qwen2"), EngineConfig(kv_cache_tokens=256, max_model_len=128))
    prompt = list(range(1, 61))
    params = SamplingParams(temperature=0, max_tokens=10)
    first = engine.generate([prompt], params)
    computed = engine.stats.prompt_tokens_computed
    again = engine.generate([prompt], params)
    assert samples(first) == samples(again)
    assert engine.stats.prompt_tokens_computed - computed == 1  # only the last prompt token
    # A continuation of prompt + output hits the cache past the prompt too.
    cont = prompt + first[0].samples[0].token_ids
    before = engine.stats.cache_hit_tokens
    engine.generate([cont + [5]], params)
    assert engine.stats.cache_hit_tokens - before >= len(prompt) + 9
    # Other prompts fill the pool: the old entries are evicted, and everything still works.
    rng = random.Random(0)
    others = [[rng.randrange(128) for _ in range(100)] for _ in range(6)]
    run_checked(engine, others, params)
    assert engine.cached_prefix_len(prompt) < len(prompt) - 1


def test_caching_off_gives_same_outputs_and_computes_everything():
    prompts, _ = grpo_prompts(num_prompts=4, prefix_len=32, prompt_len=48)
    params = SamplingParams(n=3, temperature=0.8, max_tokens=6, seed=7)
    on = Engine(tiny_model("qwen3"), EngineConfig(kv_cache_tokens=4096, max_model_len=128))
    off = Engine(tiny_model("qwen3"), EngineConfig(kv_cache_tokens=4096, max_model_len=128,
                                                   enable_prefix_caching=False))
    a = run_checked(on, prompts, params)
    b = run_checked(off, prompts, params)
    assert samples(a) == samples(b)
    assert off.stats.prompt_tokens_computed == off.stats.prompt_tokens
    assert on.stats.prompt_tokens_computed < off.stats.prompt_tokens_computed


def test_lpm_and_fcfs_give_the_same_outputs():
    prompts, _ = grpo_prompts(num_prompts=6, prefix_len=20, prompt_len=30)
    params = SamplingParams(n=2, temperature=1.0, max_tokens=6, seed=3)
    outs = []
    for policy in ("lpm", "fcfs"):
        engine = Engine(tiny_model("llama"), EngineConfig(kv_cache_tokens=1024, max_model_len=64,
                                                          schedule_policy=policy,
                                                          max_num_batched_tokens=40))
        outs.append(samples(run_checked(engine, prompts, params)))
    assert outs[0] == outs[1]
