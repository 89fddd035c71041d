"""A live model's rounded rotary frequencies (rollout/models/layers/rotary.py
adopt_rounded_frequencies): `model.to(torch.bfloat16)` casts transformers' inv_freq buffer and
transformers builds its angles from it, so the engine takes those values; float32 buffers (an
fp32 model, `from_pretrained(dtype=...)`) leave the engine's own."""

import importlib

import pytest
import torch
from models import tiny_model

from rollout import Engine, EngineConfig, SamplingParams
from rollout.models.layers import rotary
from rollout.models.layers.rotary import RotaryEmbedding

CONFIG = dict(kv_cache_tokens=2048, max_model_len=512)
GREEDY = SamplingParams(temperature=0, max_tokens=8, logprobs=True)


def ropes(engine):
    return [m for m in engine.model.modules() if isinstance(m, RotaryEmbedding)]


def mean_gap(model, engine, length: int) -> float:
    """The engine's mean logprob gap to `model`'s own forward, greedy after a random prompt."""
    gen = torch.Generator().manual_seed(length)
    prompt = torch.randint(3, model.config.vocab_size, (length,), generator=gen).tolist()
    sample = engine.generate([prompt], GREEDY)[0].samples[0]
    with torch.no_grad():
        logits = model(torch.tensor([prompt + sample.token_ids])).logits[0, length - 1:-1]
    ref = logits.float().log_softmax(-1).gather(-1, torch.tensor(sample.token_ids)[:, None])
    return (ref[:, 0] - torch.tensor(sample.logprobs)).abs().mean().item()


def test_a_cast_models_frequencies_are_taken_and_its_logprobs_follow(monkeypatch):
    model = tiny_model("qwen2", dtype=torch.bfloat16)
    theirs = model.model.rotary_emb.inv_freq
    assert theirs.dtype == torch.bfloat16
    engine = Engine(model, EngineConfig(**CONFIG))
    assert all(torch.equal(r.inv_freq, theirs.float()) for r in ropes(engine))
    adopted = mean_gap(model, engine, 300)
    monkeypatch.setattr(importlib.import_module("rollout.models.loader"),
                        "adopt_rounded_frequencies", lambda *a: 0)
    own = mean_gap(model, Engine(model, EngineConfig(**CONFIG)), 300)
    # measured: 0.013 against 0.038 (tiny Qwen2, bf16, Intel Xeon)
    assert adopted < 0.6 * own, (adopted, own)


def test_float32_buffers_leave_the_engines_own():
    model = tiny_model("qwen2")
    engine = Engine(model, EngineConfig(**CONFIG))
    want = 1.0 / (model.config.rope_parameters["rope_theta"]
                  ** (torch.arange(0, 16, 2).float() / 16))
    for r in ropes(engine):
        assert r.inv_freq.dtype == torch.float32
        torch.testing.assert_close(r.inv_freq, want[:r.inv_freq.numel()], rtol=0, atol=0)


def test_per_layer_type_frequencies_and_the_table_after_sleep():
    model = tiny_model("gemma3_text", dtype=torch.bfloat16)
    engine = Engine(model, EngineConfig(**CONFIG))
    for r in ropes(engine):
        theirs = getattr(model.model.rotary_emb, f"{r.layer_type}_inv_freq")
        assert theirs.dtype == torch.bfloat16 and torch.equal(r.inv_freq, theirs.float())
    before = [r.cos_table.clone() for r in ropes(engine)]
    engine.sleep(2)
    engine.wake_up()
    engine.update_weights(model)
    assert all(torch.equal(r.cos_table, b) for r, b in zip(ropes(engine), before))


@pytest.mark.parametrize("length_dependent", [False, True])
def test_only_tables_built_once_for_every_length_adopt(length_dependent):
    model = tiny_model("llama", dtype=torch.bfloat16)
    engine = Engine(model, EngineConfig(**CONFIG))
    theirs = model.model.rotary_emb.inv_freq.float()
    for r in ropes(engine):
        r.length_dependent = length_dependent
        r.inv_freq = r.inv_freq + 1.0  # marked: taking the buffer again undoes it
    taken = rotary.adopt_rounded_frequencies(engine.model, model)
    assert taken == (0 if length_dependent else len(ropes(engine)))
    for r in ropes(engine):
        assert torch.equal(r.inv_freq, theirs + 1.0 if length_dependent else theirs)


def test_a_draft_model_takes_its_own_frequencies():
    from rollout.spec import SpeculativeConfig

    target = tiny_model("qwen2", dtype=torch.bfloat16)
    draft = tiny_model("qwen2", dtype=torch.bfloat16, seed=3, rope_theta=5000.0)
    engine = Engine(target, EngineConfig(**CONFIG, speculative=SpeculativeConfig(
        method="draft", draft_model=draft, num_speculative_tokens=2)))
    drafted = [m for m in engine.speculator.drafter.stack.model.modules()
               if isinstance(m, RotaryEmbedding)]
    assert drafted and all(torch.equal(r.inv_freq, draft.model.rotary_emb.inv_freq.float())
                           for r in drafted)
