"""Request intake: params are checked (again) when a request arrives, a failed call changes
nothing, request ids never clash, and generate() does not swallow streaming outputs."""

import numpy as np
import pytest
import torch
from helpers import samples
from models import tiny_model

from rollout import Engine, EngineConfig, SamplingParams
from rollout.fields import SEED_LIMIT
from rollout.sample.params import MIN_TEMPERATURE


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def make_engine(model, **kw):
    return Engine(model, EngineConfig(kv_cache_tokens=512, max_model_len=32, **kw))


def drain(engine) -> dict:
    done = {}
    while engine.has_unfinished:
        done.update({o.request_id: o for o in engine.step()})
    return done


def test_streaming_request_finishing_inside_generate_comes_out_of_the_next_step(model):
    engine = make_engine(model)
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    expected = samples(make_engine(model).generate([[1, 2, 3]], params))
    rid = engine.add_request([1, 2, 3], params)
    engine.generate([[4, 5, 6]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert engine.has_unfinished  # its output is still to be collected
    outs = engine.step()
    assert [o.request_id for o in outs] == [rid]
    assert samples(outs) == expected
    assert not engine.has_unfinished and engine.step() == []


def test_failed_generate_draws_no_seeds(model):
    params = SamplingParams(temperature=1.0, max_tokens=8)  # unseeded: the engine draws seeds
    good = [[1, 2, 3], [4, 5, 6]]
    expected = samples(make_engine(model, seed=0).generate(good, params))
    engine = make_engine(model, seed=0)
    with pytest.raises(ValueError, match="prompt"):
        engine.generate(good + [[999]], params)
    with pytest.raises(ValueError, match="temperature"):
        engine.generate(good, [params, SamplingParams(temperature=-1.0)])
    assert not engine.has_unfinished
    assert samples(engine.generate(good, params)) == expected


@pytest.mark.parametrize("field, value", [
    ("temperature", -1.0), ("n", 0), ("max_tokens", 0), ("top_p", 0.0), ("seed", 1.5),
    ("stop_token_ids", [-1]), ("logprobs", "yes"),
])
def test_params_edited_after_construction_are_checked_at_intake(model, field, value):
    engine = make_engine(model)
    params = SamplingParams(max_tokens=4)
    setattr(params, field, value)
    with pytest.raises(ValueError, match=field):
        engine.add_request([1, 2, 3], params)
    with pytest.raises(ValueError, match=field):
        engine.generate([[1, 2, 3]], params)
    assert not engine.has_unfinished


def test_editing_params_does_not_change_running_requests(model):
    engine = make_engine(model)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    rid = engine.add_request([1, 2, 3], params)
    engine.step()
    params.max_tokens, params.temperature = 2, 1.0  # reused for the next batch
    assert len(drain(engine)[rid].samples[0].token_ids) == 20


def test_auto_request_ids_skip_ids_in_use(model):
    engine = make_engine(model)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    mine = ["1", "2", "3"]  # numbers, as the engine's own ids are
    for rid in mine:
        engine.add_request([1, 2, 3], SamplingParams(max_tokens=30, ignore_eos=True),
                           request_id=rid)
    outs = engine.generate([[6, 7], [8, 9]], params)
    assert {o.request_id for o in outs}.isdisjoint(mine)
    auto = engine.add_request([6, 7], params)
    assert auto not in {*mine, *(o.request_id for o in outs)}
    assert set(drain(engine)) == {*mine, auto}


def test_finished_but_uncollected_request_id_stays_taken(model):
    engine = make_engine(model)
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=1), request_id="a")
    engine.generate([[4, 5, 6]], SamplingParams(max_tokens=4, ignore_eos=True))
    with pytest.raises(ValueError, match="request_id"):
        engine.add_request([1, 2, 3], request_id="a")
    assert [o.request_id for o in engine.step()] == ["a"]


@pytest.mark.parametrize("temperature", [1e-38, 1e-30, MIN_TEMPERATURE / 2])
def test_tiny_temperature_is_rejected(temperature):
    with pytest.raises(ValueError, match=f"temperature.*{MIN_TEMPERATURE:g}"):
        SamplingParams(temperature=temperature)


def test_smallest_temperature_samples_finite_logprobs(model):
    params = SamplingParams(temperature=MIN_TEMPERATURE, max_tokens=4, logprobs=True, seed=0)
    sample = make_engine(model).generate([[1, 2, 3]], params)[0].samples[0]
    assert len(sample.logprobs) == 4 and all(np.isfinite(sample.logprobs))


@pytest.mark.parametrize("kwargs, message", [
    ({"stop_token_ids": 5}, "stop_token_ids"), ({"stop": 5}, "stop"),
    ({"ignore_eos": "no"}, "ignore_eos"), ({"logprobs": "yes"}, "logprobs"),
    ({"logprobs": 21}, "logprobs must be"), ({"logprobs": -1}, "logprobs must be"),
    ({"top_logprobs": 21}, "top_logprobs must be"), ({"top_logprobs": True}, "top_logprobs"),
    ({"logprobs": 3, "top_logprobs": 5}, "logprobs=3 asks for 3"),
    ({"seed": SEED_LIMIT}, "seed.*2\\*\\*64"),
    ({"seed": -1}, "seed.*2\\*\\*64"), ({"stop_token_ids": [True]}, "stop_token_ids"),
    ({"n": True}, "n"),
])
def test_bad_param_types_and_ranges_raise_value_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_largest_seed_is_accepted(model):
    params = SamplingParams(seed=SEED_LIMIT - 1, max_tokens=4)
    assert len(make_engine(model).generate([[1, 2]], params)[0].samples[0].token_ids) == 4


def test_numpy_integers_are_token_ids(model):
    params = SamplingParams(temperature=0, max_tokens=6, stop_token_ids=[7])
    np_params = SamplingParams(temperature=0, n=np.int32(1), max_tokens=np.int64(6),
                               stop_token_ids=np.array([7]))
    assert np_params.stop_token_ids == [7] and type(np_params.stop_token_ids[0]) is int
    expected = samples(make_engine(model).generate([[1, 2, 3]], params))
    engine = make_engine(model)
    outs = engine.generate([[np.int64(1), np.int32(2), np.uint8(3)]], np_params)
    assert samples(outs) == expected
    assert all(type(t) is int for t in outs[0].prompt_token_ids)


@pytest.mark.parametrize("token", [2.0, True, np.float32(2), "2"])
def test_non_integer_prompt_token_says_so(model, token):
    with pytest.raises(ValueError, match="prompt: token id must be an int"):
        make_engine(model).add_request([1, token])


def test_a_prompt_on_the_meta_device_says_it_holds_no_ids(model):
    engine = make_engine(model)
    running = engine.add_request([1, 2, 3], SamplingParams(temperature=0, max_tokens=4))
    with pytest.raises(ValueError, match="prompt: a meta tensor holds no token ids"):
        engine.add_request(torch.ones(3, dtype=torch.long, device="meta"))
    assert set(drain(engine)) == {running}
