"""Hostile field values: every one raises ValueError naming the field (and, for a range, its
limit) instead of a TypeError/OverflowError or a failure at every step, and the engine keeps
serving. tests/engine/test_bad_input.py and test_request_intake.py hold the plainer cases."""

import math
import re

import numpy as np
import pytest
import torch
from helpers import samples
from models import tiny_model

import rollout.engine.engine
from rollout import Engine, EngineConfig, SamplingParams
from rollout.fields import INT32_MAX, INT32_MIN, show
from rollout.sample.params import MAX_N, MAX_TEMPERATURE
from rollout.spec import SpeculativeConfig

HUGE = 10**400  # float(HUGE) raises OverflowError; str(10**5000) raises ValueError
GREEDY = SamplingParams(temperature=0, max_tokens=5)
# None is left out: it is valid for some fields (seed, kv_cache_tokens).
NOT_A_NUMBER = [True, "1", [1], torch.tensor([1]), np.array([1.0])]
NOT_AN_INT = [*NOT_A_NUMBER, 2.0, np.float32(2), torch.tensor(2.0), math.inf]


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen2")


def make_engine(model, **kw):
    return Engine(model, EngineConfig(kv_cache_tokens=256, max_model_len=64, **kw))


def cases(field, values):
    # Ids through show(): pytest's own str() of 10**5000 raises.
    return [pytest.param(field, v, id=f"{field}={show(v)}") for v in values]


BAD_PARAMS = [
    *cases("top_k", [*NOT_AN_INT, None, HUGE]), *cases("n", [*NOT_AN_INT, None, -1, 10**5000]),
    *cases("max_tokens", [*NOT_AN_INT, None, -1, HUGE]), *cases("seed", [*NOT_AN_INT, HUGE]),
    *cases("temperature", [*NOT_A_NUMBER, None, HUGE, -HUGE, math.inf, -math.inf, 1j,
                           torch.tensor(True), np.float64("nan")]),
    *cases("top_p", [*NOT_A_NUMBER, None, HUGE, math.nan, math.inf, -0.1]),
    *cases("min_p", [*NOT_A_NUMBER, None, HUGE, math.nan, -math.inf, 1.5]),
    *cases("stop_token_ids", [[2**31], [HUGE], [1.5], ["1"], [None], [[1]], torch.tensor(3),
                              b"1", {1: 2}]),
    *cases("stop", [[5], [None], ["a", ""], {"a": 1}, b"a"]),
    *cases("ignore_eos", [None, 0, "no", [True]]), *cases("logprobs", [None, 1.0, [True]]),
]


@pytest.mark.parametrize("field, value", BAD_PARAMS)
def test_bad_sampling_param_names_the_field(field, value):
    with pytest.raises(ValueError, match=rf"^{field}\b"):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("value", [3.0, True, torch.tensor([3, 3]), np.array([1, 2]), "3", -1],
                         ids=show)
def test_bad_top_logprobs_beside_logprobs_k_names_it(value):
    """Checked before it is compared with k (a tensor had raised torch's RuntimeError, 3.0
    had been taken for 3)."""
    with pytest.raises(ValueError, match=r"^top_logprobs\b"):
        SamplingParams(logprobs=3, top_logprobs=value)


@pytest.mark.parametrize("field, value, limit", [
    ("top_k", INT32_MAX + 1, "2**31 - 1"), ("top_k", INT32_MIN - 1, "-2**31"),
    ("max_tokens", INT32_MAX + 1, "2**31 - 1"), ("n", MAX_N + 1, "2**16"),
    ("stop_token_ids", [INT32_MAX + 1], "2**31 - 1"),
    ("temperature", 1e39, f"{MAX_TEMPERATURE:g}"), ("seed", HUGE, "2**64 - 1"),
], ids=show)
def test_out_of_range_sampling_param_names_the_limit(field, value, limit):
    with pytest.raises(ValueError, match=rf"^{field}\b.*{re.escape(limit)}"):
        SamplingParams(**{field: value})


def test_numpy_and_0d_tensor_params_become_plain_python_values():
    params = SamplingParams(n=np.int64(2), top_k=torch.tensor(3), max_tokens=np.array(4),
                            temperature=np.float32(0.5), top_p=torch.tensor(0.5), min_p=0,
                            stop_token_ids=torch.tensor([1, 2]), seed=np.uint64(2**64 - 1),
                            logprobs=np.bool_(True), ignore_eos=torch.tensor(False))
    assert (params.n, params.top_k, params.max_tokens, params.stop_token_ids) == (2, 3, 4, [1, 2])
    assert (params.temperature, params.top_p, params.min_p) == (0.5, 0.5, 0.0)
    assert params.logprobs is True and params.ignore_eos is False
    for k in (np.int64(3), np.array(3), torch.tensor(3)):  # logprobs=k as every int field
        given = SamplingParams(logprobs=k).logprobs
        assert type(given) is int and given == 3
    for value in [params.n, params.top_k, params.max_tokens, *params.stop_token_ids, params.seed]:
        assert type(value) is int
    for value in [params.temperature, params.top_p, params.min_p]:
        assert type(value) is float


def test_int32_extremes_of_top_k_reach_the_sampler(model):
    # Both mean "no top-k" on a 128-token vocabulary; one past them would overflow int32.
    engine = make_engine(model)
    params = [SamplingParams(max_tokens=5, seed=1, top_k=k) for k in (0, INT32_MAX, INT32_MIN)]
    outs = samples(engine.generate([[1, 2, 3]] * 3, params))
    assert outs[0] == outs[1] == outs[2]


@pytest.mark.parametrize("field, value", [
    ("top_k", INT32_MAX + 1), ("temperature", HUGE), ("max_tokens", 2.0), ("n", "2"),
    ("stop_token_ids", [HUGE]), ("top_p", torch.tensor([0.5])), ("seed", -1),
], ids=show)
def test_refused_request_leaves_the_engine_generating_the_same(model, field, value):
    engine = make_engine(model)
    before = samples(engine.generate([[1, 2, 3]], GREEDY))
    params = SamplingParams()
    setattr(params, field, value)  # set after construction: intake validates again
    with pytest.raises(ValueError, match=rf"^{field}\b"):
        engine.add_request([1, 2, 3], params)
    with pytest.raises(ValueError, match=rf"^{field}\b"):
        engine.generate([[1, 2, 3], [4, 5]], [GREEDY, params])
    assert not engine.has_unfinished
    assert samples(engine.generate([[1, 2, 3]], GREEDY)) == before


BAD_CONFIG = [
    *cases("kv_cache_tokens", [*NOT_AN_INT, 0, 2**31, HUGE]),
    *cases("kv_memory_fraction", [*NOT_A_NUMBER, None, 1.5, -0.1, math.nan, math.inf, HUGE]),
    *cases("max_model_len", [*NOT_AN_INT, 1, 2**31]),  # (None: the model's, up to 4096)
    *cases("max_num_seqs", [*NOT_AN_INT, None, 0, 2**31]),
    *cases("max_num_batched_tokens", [*NOT_AN_INT, None, 0, 2**31, HUGE]),
    *cases("lpm_max_waiting", [*NOT_AN_INT, None, 0]),
    *cases("schedule_policy", [None, 1, ["lpm"], np.array(["lpm", "fcfs"]), "LPM"]),
    *cases("backend", [None, "cuda", ("torch",)]),
    *cases("attention_backend", ["cuda", ("torch",)]),
    *cases("enable_prefix_caching", [None, 1, "yes"]), *cases("cuda_graphs", [0, "no", [False]]),
    *cases("pack_cpu_weights", [None, "no"]),
    *cases("keep_cpu_heap", [None, 0, "true"]),
    *cases("dtype", ["int32", torch.int32, torch.bool, torch.complex64, torch.float64, "float64",
                     torch.float8_e4m3fn, np.float32, 5, "", "torch.int8"]),
    *cases("device", ["gpu", "cuda:x", "cuda:-1", "", " cpu", "cpu:7", torch.device("cpu", 1),
                      1.5, True, 0, ["cpu"]]),
    *cases("seed", [*NOT_AN_INT, -1, 2**64, HUGE]),
]


@pytest.mark.parametrize("field, value", BAD_CONFIG)
def test_bad_engine_config_names_the_field(field, value):
    with pytest.raises(ValueError, match=rf"^{field}\b"):
        EngineConfig(**{field: value})


def test_batch_of_longest_sequences_must_fit_int32():
    EngineConfig(max_num_seqs=2**15, max_model_len=2**16 - 1)
    with pytest.raises(ValueError, match=r"^max_num_seqs \* max_model_len.*2\*\*31 - 1"):
        EngineConfig(max_num_seqs=2**15, max_model_len=2**16)


def test_bad_override_at_engine_construction_names_the_field(model):
    with pytest.raises(ValueError, match=r"^max_model_len must be in \[2, 2\*\*31 - 1\]"):
        Engine(model, EngineConfig(kv_cache_tokens=256), max_model_len=1)
    # an unknown keyword (a typo, a field since gone) too, not dataclasses' TypeError
    with pytest.raises(ValueError, match=r"^max_model_length: not an EngineConfig field "
                                         r"\(did you mean 'max_model_len'\?\)"):
        Engine(model, EngineConfig(kv_cache_tokens=256), max_model_length=64)
    with pytest.raises(ValueError, match=r"^native_cpu_kernels: not an EngineConfig field; "):
        Engine(model, EngineConfig(kv_cache_tokens=256), native_cpu_kernels=True)


def test_numpy_and_0d_tensor_config_values_become_plain_python_values(model):
    config = EngineConfig(kv_cache_tokens=np.int64(256), max_model_len=torch.tensor(64),
                          max_num_seqs=np.int32(8), kv_memory_fraction=np.float32(0.5),
                          seed=np.uint64(7), cuda_graphs=np.bool_(False), dtype="torch.float32",
                          device="cpu:0")
    assert (config.kv_cache_tokens, config.max_model_len, config.max_num_seqs) == (256, 64, 8)
    assert type(config.max_model_len) is int and type(config.kv_memory_fraction) is float
    assert (config.seed, config.cuda_graphs) == (7, False) and type(config.seed) is int
    assert (config.dtype, config.device) == (torch.float32, torch.device("cpu", 0))
    expected = samples(make_engine(model).generate([[1, 2, 3]], GREEDY))
    assert samples(Engine(model, config).generate([[1, 2, 3]], GREEDY)) == expected


def test_shortest_max_model_len_generates_one_token(model):
    engine = Engine(model, EngineConfig(kv_cache_tokens=256, max_model_len=2))
    out = engine.generate([[1]], SamplingParams(max_tokens=5))[0].samples[0]
    assert len(out.token_ids) == 1 and out.finish_reason == "length"


MISSING_DEVICES = [f"cuda:{torch.cuda.device_count()}", "cuda:3", "meta", "mps"]
if not torch.cuda.is_available():
    MISSING_DEVICES += ["cuda", torch.device("cuda", 0)]


@pytest.mark.parametrize("device", dict.fromkeys(MISSING_DEVICES))
def test_missing_device_is_refused_before_any_allocation(model, monkeypatch, device):
    def build_model(*args):
        raise AssertionError("the engine allocated its model on a device it had not checked")

    monkeypatch.setattr(rollout.engine.engine, "build_model", build_model)
    with pytest.raises(ValueError, match=r"^device\b"):
        make_engine(model, device=device)


def test_missing_device_is_refused_for_a_checkpoint_path(tmp_path):
    tiny_model("qwen2").save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"^device\b"):
        Engine(str(tmp_path), EngineConfig(kv_cache_tokens=256, max_model_len=64,
                                           device=f"cuda:{torch.cuda.device_count()}"))


def test_model_in_an_unsupported_dtype_needs_a_dtype(model):
    double = tiny_model("qwen2", dtype=torch.float64)
    with pytest.raises(ValueError, match=r"^dtype\b.*float16, bfloat16, float32.*float64"):
        make_engine(double)
    expected = samples(make_engine(model).generate([[1, 2, 3]], GREEDY))
    assert samples(make_engine(double, dtype="float32").generate([[1, 2, 3]], GREEDY)) == expected


BAD_SPECULATIVE = [
    *cases("method", [None, 1, "NGRAM", ["ngram"]]),
    *cases("acceptance", [None, "strict"]),
    *cases("num_speculative_tokens", [*NOT_AN_INT, None, 0, 17, HUGE]),
    *cases("ngram_min", [*NOT_AN_INT, None, 0, 5]),  # 5 > ngram_max
    *cases("ngram_max", [*NOT_AN_INT, None, 0]),
    *cases("max_batch_size", [*NOT_AN_INT, None, 0]),
    *cases("draft_model", ["a/checkpoint"]),  # method "ngram": it would go unused
]


@pytest.mark.parametrize("field, value", BAD_SPECULATIVE)
def test_bad_speculative_config_names_the_field(field, value):
    with pytest.raises(ValueError, match=rf"^speculative\.{field}\b"):
        SpeculativeConfig(**{field: value})


def test_numpy_speculative_sizes_become_plain_ints():
    spec = SpeculativeConfig(num_speculative_tokens=np.int64(16), ngram_min=torch.tensor(2),
                             ngram_max=np.int8(3), max_batch_size=np.uint16(64))
    sizes = (spec.num_speculative_tokens, spec.ngram_min, spec.ngram_max, spec.max_batch_size)
    assert sizes == (16, 2, 3, 64) and all(type(s) is int for s in sizes)
