"""Bad input raises ValueError naming the field, changes nothing, and the engine keeps serving."""

import math

import numpy as np
import pytest
import torch
from helpers import samples
from models import char_tokenizer, tiny_model

from rollout import Engine, EngineConfig, SamplingParams
from rollout.requests import intake


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen2")


def make_engine(model, **kw):
    return Engine(model, EngineConfig(kv_cache_tokens=1024, max_model_len=64, **kw))


@pytest.mark.parametrize("kwargs, field", [
    ({"n": 0}, "n"), ({"n": 1.5}, "n"), ({"temperature": -0.1}, "temperature"),
    ({"temperature": math.nan}, "temperature"), ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"), ({"min_p": -0.1}, "min_p"), ({"min_p": 2}, "min_p"),
    ({"max_tokens": 0}, "max_tokens"), ({"top_k": 2.5}, "top_k"), ({"seed": "x"}, "seed"),
    ({"stop": [""]}, "stop"), ({"stop_token_ids": [-1]}, "stop_token_ids"),
])
def test_bad_sampling_params(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


GOOD_PROMPTS = [[1, 2, 3], [4, 5, 6, 7]]
GREEDY12 = SamplingParams(temperature=0, max_tokens=12)


def assert_refused_while_running(make, refuse, match: str):
    """`refuse(engine)` raises ValueError matching `match` while two requests are mid-way; they
    finish exactly as on an engine that never saw it. `make()` builds a fresh engine."""
    expected = samples(make().generate(GOOD_PROMPTS, GREEDY12))
    engine = make()
    ids = [engine.add_request(p, GREEDY12) for p in GOOD_PROMPTS]
    engine.step()
    engine.step()
    with pytest.raises(ValueError, match=match):
        refuse(engine)
    assert set(engine.running_requests) == set(ids)
    engine.check_invariants()
    done = {}
    while engine.has_unfinished:
        done.update({o.request_id: o for o in engine.step()})
    assert samples([done[i] for i in ids]) == expected


@pytest.mark.parametrize("prompt, field", [
    ([], "prompt"), ([1, 2, 500], "vocabulary"), ([1, -3], "vocabulary"),
    (list(range(64)), "max_model_len"), ("hello", "tokenizer"), ([1, 2.0], "prompt"),
    (None, "prompt"), (torch.tensor([[1, 2, 3]]), r"prompt must be 1-D.*\(1, 3\)"),
])
def test_bad_prompts_raise_and_running_requests_survive(model, prompt, field):
    def refuse(engine):
        with pytest.raises(ValueError, match=field):
            engine.add_request(prompt, GREEDY12)
        engine.generate([[9, 9, 9], prompt], GREEDY12)  # the good prompt must not be queued

    assert_refused_while_running(lambda: make_engine(model), refuse, field)


@pytest.mark.parametrize("form", [list, torch.tensor, np.array])
def test_a_prompt_too_long_is_refused_before_its_tokens_are_converted(model, form, monkeypatch):
    """Its length is known without reading it: a 1M-token prompt costs no per-token work
    (converting each token first had taken 6 s for 10M), in add_request and score alike."""
    converted = []
    monkeypatch.setattr(intake, "as_int", lambda name, v, *a: converted.append(v) or int(v))
    long = form([1] * 1_000_000)

    def refuse(call):
        converted.clear()
        try:
            call()
        finally:
            assert converted == []  # not one of its tokens

    assert_refused_while_running(lambda: make_engine(model),
                                 lambda engine: refuse(lambda: engine.add_request(long)),
                                 r"prompt: 1000000 tokens, more than max_model_len - 1 = 63")
    with pytest.raises(ValueError, match=r"sequences\[0\]: 1000000 tokens, more than "
                                         r"max_model_len=64"):
        refuse(lambda: make_engine(model).score([long]))
    engine = make_engine(model)
    with pytest.raises(ValueError, match=r"probe: 1000000 tokens, more than max_model_len=64"):
        refuse(lambda: engine.update_weights(model, probe=long))
    # How much of it the cache holds reads its first max_model_len tokens only (none is longer).
    converted.clear()
    assert engine.cached_prefix_len(long) == 0 and len(converted) == 64


def test_other_bad_requests(model):
    engine = make_engine(model)
    with pytest.raises(ValueError, match="stop_token_ids"):
        engine.add_request([1, 2], SamplingParams(stop_token_ids=[128]))
    with pytest.raises(ValueError, match="stop"):
        engine.add_request([1, 2], SamplingParams(stop=["x"]))  # no tokenizer
    with pytest.raises(ValueError, match="params"):
        engine.generate([[1], [2]], [SamplingParams()])
    with pytest.raises(ValueError, match="params"):
        engine.generate([[1], [2]], (SamplingParams() for _ in range(2)))
    engine.add_request([1, 2], request_id="a")
    with pytest.raises(ValueError, match="request_id"):
        engine.add_request([3, 4], request_id="a")
    with pytest.raises(ValueError, match="request_id"):
        engine.abort("nope")
    assert engine.running_requests == ["a"]


def test_bad_config():
    for kwargs, field in [({"max_model_len": 0}, "max_model_len"),
                          ({"schedule_policy": "x"}, "schedule_policy"),
                          ({"backend": "x"}, "backend"),
                          ({"attention_backend": "x"}, "attention_backend"),
                          ({"kv_memory_fraction": 0}, "kv_memory_fraction"),
                          ({"dtype": "float33"}, "dtype")]:
        with pytest.raises(ValueError, match=field):
            EngineConfig(**kwargs)


@pytest.mark.parametrize("extra, match", [
    (None, r"^extra must be a dict .*got None"), (5, r"^extra must be a dict"),
    ([("separate_host_memory", True)], r"^extra must be a dict"),
    # a typo is refused, not ignored: the known keys are listed
    ({"seperate_host_memory": True}, r"^extra: unknown key 'seperate_host_memory'; the known "
                                     r"keys are \('separate_host_memory',\)"),
    ({1: True}, r"^extra: unknown key 1"),
    ({"separate_host_memory": "yes"}, r"^extra\['separate_host_memory'\] must be True or False"),
])
def test_bad_config_extra_is_refused_by_the_config(extra, match):
    # by EngineConfig itself: before, Engine built the model and then met an AttributeError
    with pytest.raises(ValueError, match=match):
        EngineConfig(kv_cache_tokens=256, max_model_len=32, extra=extra)


def test_config_extra_takes_its_known_keys(model):
    assert EngineConfig().extra == {}
    given = {"separate_host_memory": True}
    config = EngineConfig(kv_cache_tokens=256, max_model_len=32, extra=given)
    assert config.extra == given and config.extra is not given  # later edits don't reach it
    assert Engine(model, config).stack.parking.separate_host


@pytest.mark.parametrize("layout", ["sparse_coo", "sparse_csr"])
@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
def test_sparse_weights_are_refused_before_any_copy_and_running_requests_survive(model, layout):
    """A sparse tensor has a floating dtype but cannot be copied into the dense weights: it had
    failed half way through the copy (needs_weights, the running requests stopped)."""
    def refuse(engine):
        named = [(n, p.detach().clone()) for n, p in model.named_parameters()]
        i = max(i for i, (_, p) in enumerate(named) if p.ndim == 2)  # the dense ones before it
        name, tensor = named[i]
        named[i] = (name, tensor.to_sparse() if layout == "sparse_coo" else tensor.to_sparse_csr())
        try:
            engine.update_weights(named)
        finally:
            assert not engine.needs_weights

    assert_refused_while_running(lambda: make_engine(model), refuse,
                                 rf"weight '.*': layout torch.{layout} is not dense")


def test_pool_too_small_for_one_request_refuses_to_start(model):
    with pytest.raises(ValueError, match=r"holds 100 tokens.*max_model_len=256"):
        Engine(model, EngineConfig(kv_cache_tokens=100, max_model_len=256))


def test_bad_chat_template_kwargs_are_refused_naming_them_and_running_requests_survive():
    # The engine passes the conversation (the template's `messages`) and tokenize itself: these
    # had failed inside the template, reported as conversations[0]'s fault.
    tok = char_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    chat_model = tiny_model("qwen2", vocab_size=len(tok))
    conversation = [{"role": "user", "content": "ab"}]

    def refuse(engine):
        for kwargs in ({"conversation": []}, {"messages": 1}, {1: 2}):
            with pytest.raises(ValueError, match=r"^chat_template_kwargs: "):
                engine.chat(conversation, GREEDY12, chat_template_kwargs=kwargs)
        engine.chat(conversation, GREEDY12, chat_template_kwargs={"tokenize": True})

    assert_refused_while_running(
        lambda: Engine(chat_model, EngineConfig(kv_cache_tokens=1024, max_model_len=64),
                       tokenizer=tok), refuse, r"^chat_template_kwargs: 'tokenize'")


GOOD = [[1, 2, 3], [4, 5, 6]]
GREEDY6 = SamplingParams(temperature=0, max_tokens=6)


def poisoned_engine():
    """An engine whose embedding of token 77 is NaN, and its outputs for GOOD from before."""
    engine = Engine(tiny_model("llama"), EngineConfig(kv_cache_tokens=1024, max_model_len=64))
    expected = samples(engine.generate(GOOD, GREEDY6))
    with torch.no_grad():
        engine.model.model.embed_tokens.weight[77] = float("nan")  # poisons prompts with 77
    return engine, expected


def test_non_finite_logits_abort_only_the_affected_request():
    engine, expected = poisoned_engine()
    good, params = GOOD, GREEDY6
    # Streaming: the poisoned request comes back aborted with its error, the others finish.
    ids = [engine.add_request(p, params) for p in good]
    bad = engine.add_request([7, 77, 8], params)
    done = {}
    while engine.has_unfinished:
        done.update({o.request_id: o for o in engine.step()})
        engine.check_invariants()
    assert samples([done[i] for i in ids]) == expected
    assert all(done[i].error is None for i in ids)
    assert "non-finite" in done[bad].error
    assert [s.finish_reason for s in done[bad].samples] == ["abort"]
    # In one generate() call: the same, and the results keep their order.
    outs = engine.generate([good[0], [7, 77, 8], good[1]], SamplingParams(temperature=0,
                                                                           max_tokens=6, n=2))
    engine.check_invariants()
    assert [o.error is None for o in outs] == [True, False, True]
    assert {s.finish_reason for s in outs[1].samples} == {"abort"}
    assert [o.samples[0].token_ids for o in (outs[0], outs[2])] == [e[0] for e in expected]


def test_non_finite_streaming_request_leaves_a_generate_beside_it_alone():
    engine, expected = poisoned_engine()
    bad = engine.add_request([7, 77, 8], GREEDY6)
    assert samples(engine.generate(GOOD, GREEDY6)) == expected
    (out,) = engine.step()  # held for step() while generate() ran
    assert out.request_id == bad and "non-finite" in out.error
    assert not engine.has_unfinished
    engine.check_invariants()


def test_k_v_of_a_request_aborted_for_non_finite_logits_is_not_cached():
    # The bad token is in the first, unsampled chunk; the abort comes a step later. Its prefix
    # [1..5] (K/V poisoned through the chunk's attention) must not reach the radix tree, where
    # a healthy prompt sharing it would pick it up.
    model = tiny_model("llama")
    params = SamplingParams(temperature=0, max_tokens=4)
    healthy = [1, 2, 3, 4, 5, 6]
    expected = samples(Engine(model, EngineConfig(kv_cache_tokens=256, max_model_len=32))
                       .generate([healthy], params))
    engine = Engine(model, EngineConfig(kv_cache_tokens=256, max_model_len=32,
                                        max_num_batched_tokens=6))
    with torch.no_grad():
        engine.model.model.embed_tokens.weight[100] = float("nan")
    (out,) = engine.generate([[1, 2, 3, 4, 5, 100, 7, 8]], params)
    assert "non-finite" in out.error and out.samples[0].finish_reason == "abort"
    engine.check_invariants()
    assert engine.cached_prefix_len(healthy) == 0
    assert samples(engine.generate([healthy], params)) == expected
