"""Admission order under the two schedule policies, and the automatically sized KV pool.

`schedule_policy="lpm"` admits the waiting request with the longest cached prefix first; "fcfs"
admits in arrival order. With max_num_seqs=1 one request runs at a time, so the order in which
outputs come out of step() is the admission order, and the cache hits counted after the first
step tell which request that step admitted.

`kv_cache_tokens=None` sizes the pool from `kv_memory_fraction` of the free memory the device
reports (rollout/kv_pool.py), capped at what max_num_seqs requests of max_model_len could use,
and refuses to start when one max_model_len request cannot fit. The free-memory reading is
replaced here, so the sizes are exact.
"""

import pytest
import torch
from models import tiny_model

import rollout.kv_pool as kv_pool
from rollout import Engine, EngineConfig, SamplingParams

CACHED = list(range(1, 21))  # 20 tokens, in the prefix cache before the race below
COLD = [30, 31, 32, 33]  # shares nothing with CACHED
PARAMS = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)


def race(policy: str, **config):
    """COLD is queued first, CACHED + [40] second. Returns (request ids in the order they
    finished, their names, cache-hit tokens counted by the first step)."""
    engine = Engine(tiny_model("llama"), EngineConfig(kv_cache_tokens=256, max_model_len=64,
                                                      max_num_seqs=1, schedule_policy=policy,
                                                      **config))
    engine.generate([CACHED], PARAMS)
    hits = engine.stats.cache_hit_tokens
    names = {engine.add_request(COLD, PARAMS): "cold",
             engine.add_request(CACHED + [40], PARAMS): "warm"}
    order = [o.request_id for o in engine.step()]
    first_step_hits = engine.stats.cache_hit_tokens - hits
    while engine.has_unfinished:
        order += [o.request_id for o in engine.step()]
        engine.check_invariants()
    return [names[r] for r in order], first_step_hits


def test_lpm_admits_the_cache_hitting_request_first():
    order, hits = race("lpm")
    assert order == ["warm", "cold"]
    assert hits == len(CACHED)  # the first step admitted the warm request, on the cache


def test_fcfs_admits_in_arrival_order():
    order, hits = race("fcfs")
    assert order == ["cold", "warm"]
    assert hits == 0  # the first step admitted the cold request


def test_lpm_falls_back_to_fcfs_above_lpm_max_waiting():
    order, hits = race("lpm", lpm_max_waiting=1)  # 2 waiting: sorting is skipped
    assert order == ["cold", "warm"] and hits == 0


def test_lpm_without_prefix_caching_is_fcfs():
    order, hits = race("lpm", enable_prefix_caching=False)
    assert order == ["cold", "warm"] and hits == 0


# --- the automatically sized pool -------------------------------------------------------------
MAX_MODEL_LEN, MAX_NUM_SEQS = 64, 16


def per_token_bytes() -> int:
    """K and V bytes per token of the tiny model, read off an engine with a known pool size."""
    engine = Engine(tiny_model("llama"), EngineConfig(kv_cache_tokens=100, max_model_len=64))
    assert engine.pool.num_slots == 100
    return engine.pool.nbytes // 100


def auto_engine(monkeypatch, free_bytes: int, fraction: float = 0.5) -> Engine:
    devices = []
    monkeypatch.setattr(kv_pool, "available_memory",
                        lambda device: devices.append(device) or free_bytes)
    engine = Engine(tiny_model("llama"), EngineConfig(kv_cache_tokens=None,
                                                      kv_memory_fraction=fraction,
                                                      max_model_len=MAX_MODEL_LEN,
                                                      max_num_seqs=MAX_NUM_SEQS))
    assert devices == [torch.device("cpu")]  # the engine's device was asked, once
    return engine


@pytest.mark.parametrize("tokens, fraction", [(300, 0.5), (300, 0.25), (64, 1.0)])
def test_auto_pool_takes_its_fraction_of_free_memory(monkeypatch, tokens, fraction):
    per_token = per_token_bytes()
    # Free memory worth 300 tokens / fraction, plus less than one token that must not count.
    free = int(tokens * per_token / fraction) + per_token // 3
    engine = auto_engine(monkeypatch, free, fraction)
    assert engine.pool.num_slots == tokens
    assert engine.pool.nbytes == tokens * per_token
    outs = engine.generate([[1, 2, 3]], SamplingParams(n=2, temperature=0, max_tokens=4))
    assert len(outs[0].samples) == 2
    engine.check_invariants()


def test_auto_pool_is_capped_at_what_the_sequences_can_use(monkeypatch):
    engine = auto_engine(monkeypatch, 1 << 40)  # 1 TiB free
    assert engine.pool.num_slots == MAX_NUM_SEQS * MAX_MODEL_LEN


def test_auto_pool_refuses_when_one_request_cannot_fit(monkeypatch):
    per_token = per_token_bytes()
    free = 2 * (MAX_MODEL_LEN - 1) * per_token  # half of it: one token short
    with pytest.raises(ValueError, match=rf"kv_cache_tokens: the KV pool holds "
                                         rf"{MAX_MODEL_LEN - 1} tokens .* one request of "
                                         rf"max_model_len={MAX_MODEL_LEN} tokens needs "
                                         rf"{MAX_MODEL_LEN}"):
        auto_engine(monkeypatch, free)
    # One token more is enough.
    assert auto_engine(monkeypatch, free + 2 * per_token).pool.num_slots == MAX_MODEL_LEN


def test_auto_pool_with_the_real_reading():
    engine = Engine(tiny_model("llama"), EngineConfig(kv_cache_tokens=None, max_model_len=32,
                                                      max_num_seqs=4))
    assert engine.pool.num_slots == 4 * 32  # this machine has far more than 128 tokens' worth


def test_free_memory_reading_on_cuda_is_what_the_driver_reports(monkeypatch):
    asked = []
    monkeypatch.setattr(torch.cuda, "mem_get_info",
                        lambda device=None: asked.append(device) or (123 << 20, 80 << 30))
    assert kv_pool.available_memory(torch.device("cuda", 1)) == 123 << 20
    assert asked == [torch.device("cuda", 1)]
