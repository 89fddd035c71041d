"""A draft model's KV pool has as many slots as the target's (it tracks the same sequences), so
the pool's size is checked against memory with both pools' bytes a slot: the draft's pool lay
outside every check (executor/stack.py pool_slots), an out-of-memory error at build on a device
where `kv_cache_tokens` had passed, and a `kv_memory_fraction` overrun by the draft's share."""

import pytest
from models import tiny_model

import rollout.kv.pool as kv_pool
from rollout import Engine, EngineConfig, SpeculativeConfig
from rollout.executor.stack import slot_bytes

TOKENS = 1000


def build(draft, **config):
    return Engine(tiny_model("llama"), EngineConfig(
        max_model_len=64, **config,
        speculative=SpeculativeConfig("draft", num_speculative_tokens=2, draft_model=draft)))


@pytest.fixture
def draft():
    return tiny_model("llama", seed=3, num_hidden_layers=2)


def test_an_explicit_pool_that_fits_the_target_alone_is_refused(draft, monkeypatch):
    target_bytes = slot_bytes(Engine(tiny_model("llama"), EngineConfig(
        kv_cache_tokens=TOKENS, max_model_len=64)).model, kv_pool.torch.float32)
    # Room for the target's pool and not the draft's (the draft's weights are already out of
    # what the device reports: the engine sizes the pool after building the draft).
    monkeypatch.setattr(kv_pool, "available_memory", lambda device: TOKENS * target_bytes + 100)
    with pytest.raises(ValueError, match="^kv_cache_tokens=1000 needs"):
        build(draft, kv_cache_tokens=TOKENS)


def test_a_pool_sized_from_memory_leaves_room_for_the_draft(draft, monkeypatch):
    budget = 4 * TOKENS * 1024
    monkeypatch.setattr(kv_pool, "available_memory", lambda device: budget)
    engine = build(draft, kv_memory_fraction=0.5)
    draft_pool = engine.speculator.drafter.stack.pool
    assert draft_pool.num_slots == engine.pool.num_slots
    both = (slot_bytes(engine.model, engine.pool.dtype)
            + slot_bytes(engine.speculator.drafter.stack.model, engine.pool.dtype))
    assert engine.pool.num_slots == int(budget * 0.5) // both  # the budget counts both pools
