"""rollout.generate: one engine per model object, kept in step with the model's weights."""

import pytest
import torch
from models import tiny_model
from reference import assert_paths_agree

import rollout
from rollout import Engine, EngineConfig, SamplingParams
from rollout.api import engine_for

CONFIG = dict(kv_cache_tokens=512, max_model_len=64)
PROMPTS = [[1, 2, 3], [4, 5, 6, 7]]
GREEDY = SamplingParams(temperature=0, max_tokens=10, logprobs=True)


def tokens(outs):
    return [o.samples[0].token_ids for o in outs]


def test_generate_reuses_its_engine_and_follows_optimizer_steps():
    model = tiny_model("llama")
    first = rollout.generate(model, PROMPTS, GREEDY, **CONFIG)
    engine = engine_for(model, **CONFIG)
    again = rollout.generate(model, PROMPTS, GREEDY, **CONFIG)
    assert tokens(again) == tokens(first)  # the second call hits the prefix cache
    assert_paths_agree(model, PROMPTS, GREEDY, first, again)
    assert engine_for(model, **CONFIG) is engine
    optimizer = torch.optim.SGD(model.parameters(), lr=5.0)
    loss = model(torch.tensor([PROMPTS[1]]), labels=torch.tensor([PROMPTS[1]])).loss
    loss.backward()
    optimizer.step()
    after = rollout.generate(model, PROMPTS, GREEDY, **CONFIG)
    fresh = Engine(model, EngineConfig(**CONFIG)).generate(PROMPTS, GREEDY)
    assert tokens(after) == tokens(fresh) != tokens(first)
    engine.sleep(2)  # asleep without weights: the next call wakes and refills it
    assert tokens(rollout.generate(model, PROMPTS, GREEDY, **CONFIG)) == tokens(fresh)
    assert engine_for(model, max_model_len=32, kv_cache_tokens=512) is not engine


@pytest.mark.parametrize("length", [None, 4096], ids=["left-out", "the-default-given"])
def test_an_engine_whose_max_model_len_was_left_out_is_reused(length):
    """The engine keeps its config with max_model_len fitted to the model (None -> 4096): a
    call asking with it left out, or with the number it became, is the same engine (a
    comparison with the unfitted config had rebuilt the engine, pool and weights every call)."""
    model = tiny_model("llama")
    engine = engine_for(model, kv_cache_tokens=4096)
    assert engine.config.max_model_len == 4096
    assert engine_for(model, kv_cache_tokens=4096, max_model_len=length) is engine


def test_a_model_of_inference_tensors():
    """Made under torch.inference_mode, its parameters keep no version counter (reading one
    raised): generate works as for any model, and follows a change of its weights' storage."""
    with torch.inference_mode():
        model = tiny_model("llama")
    first = rollout.generate(model, PROMPTS, GREEDY, **CONFIG)
    assert tokens(first) == tokens(Engine(model, EngineConfig(**CONFIG)).generate(PROMPTS,
                                                                                GREEDY))
    with torch.inference_mode():
        for p in model.parameters():
            p.data = p.data * 3  # a new storage: its address changes
    after = rollout.generate(model, PROMPTS, GREEDY, **CONFIG)
    assert tokens(after) == tokens(Engine(model, EngineConfig(**CONFIG)).generate(PROMPTS,
                                                                                GREEDY))
    assert tokens(after) != tokens(first)


@pytest.mark.parametrize("junk", [None, 5, {"a": 1}, b"path"])
def test_generate_refuses_what_is_not_a_model_as_engine_does(junk):
    # Refused with Engine's own ValueError naming `model`: the engine cache's weak-key lookup
    # had raised a TypeError first.
    with pytest.raises(ValueError) as engine_refusal:
        Engine(junk)
    assert str(engine_refusal.value).startswith("model must be a transformers PreTrainedModel")
    for call in (lambda: rollout.generate(junk, [[1, 2]]), lambda: engine_for(junk)):
        with pytest.raises(ValueError) as refusal:
            call()
        assert str(refusal.value) == str(engine_refusal.value)
