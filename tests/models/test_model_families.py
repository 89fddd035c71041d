"""Family-specific parity with transformers (fp32, tiny random configs) beyond the shared test of
test_parity.py: sliding windows that cut the prompt (and the same weights without them),
per-layer windows, Phi-3's LongRoPE and partial rotary; and the model contract itself (weight
tables, the registry, the engine touching models only through the contract)."""

import io
import pathlib
import tokenize

import pytest
import torch
from models import FAMILIES, tiny_model
from reference import assert_matches_reference

from rollout import Engine, EngineConfig, SamplingParams
from rollout.colocation.weights import model_tensors
from rollout.models import MODEL_REGISTRY, model_class
from rollout.models.loader import build_model

LONG = [list(range(3, 43)), [42] * 17, [5, 99, 3, 100, 6, 7, 8, 9, 10, 11, 12, 13]]


def generate(model, prompts=LONG, max_tokens=16, **config):
    engine = Engine(model, EngineConfig(kv_cache_tokens=2048, max_model_len=config.pop(
        "max_model_len", 128), **config))
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                   logprobs=True))
    engine.check_invariants()
    assert_matches_reference(model, prompts, outs)
    return engine, outs


def logprobs(outs):
    return [lp for o in outs for s in o.samples for lp in s.logprobs]


@pytest.mark.parametrize("family,no_window", [
    ("gemma2", {"sliding_window": 4096}), ("gemma3_text", {"sliding_window": 4096}),
    ("mistral", {"sliding_window": None})])
def test_a_window_shorter_than_the_prompt_matches_transformers(family, no_window):
    """Window 8, prompts of 12-40 tokens: each model matches its reference, and the same
    weights without the window give other outputs (so the window was applied)."""
    windowed = tiny_model(family, sliding_window=8)
    engine, outs = generate(windowed)
    assert 8 in engine.model.kv_layout.windows
    _, unwindowed = generate(tiny_model(family, **no_window))
    diff = max(abs(a - b) for a, b in zip(logprobs(outs), logprobs(unwindowed)))
    assert diff > 1e-2


# Which layers each reference slides its `sliding_window` over: the attribute alone decides
# nothing (transformers' Llama keeps it and never windows; Mistral, Mixtral, Phi-3 and
# Qwen3-MoE window every layer whatever `layer_types` says; Qwen2/3 and Gemma follow
# `layer_types`).
@pytest.mark.parametrize("family,overrides,windows", [
    ("llama", {}, (None, None)),
    ("mistral", {"layer_types": ["sliding_attention", "full_attention"]}, (8, 8)),
    ("mixtral", {}, (8, 8)),
    ("phi3", {}, (8, 8)),
    ("qwen3_moe", {"use_sliding_window": True}, (8, 8)),
    ("qwen3", {"use_sliding_window": True, "max_window_layers": 1}, (None, 8)),
])
def test_each_family_windows_the_layers_its_reference_windows(family, overrides, windows):
    model = tiny_model(family, num_hidden_layers=2, sliding_window=8, **overrides)
    engine, _ = generate(model)
    assert engine.model.kv_layout.windows == windows


@pytest.mark.parametrize("family,rotated", [("llama", 16), ("qwen2", 16), ("phi3", 8)])
def test_partial_rotary_factor_is_honoured_where_the_reference_honours_it(family, rotated):
    """transformers' default RoPE reads `partial_rotary_factor` in Phi-3 only: the other
    families rotate the whole head whatever the config holds (a Llama or Qwen2 served with
    half its dimensions rotated had logprob gaps of 6 nats)."""
    model = tiny_model(family, head_dim=16, partial_rotary_factor=0.5)
    engine, _ = generate(model)
    assert engine.model.rope.rotary_dim == rotated


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_partial_rotary_with_a_scaling_is_refused_where_the_reference_rotates_whole_heads(
        family):
    """A scaled RoPE (linear here) with partial_rotary_factor 0.5 in a family whose reference
    rotates whole heads: transformers builds half the frequencies and fails on the heads; the
    engine served a half rotation that no reference computes. (Phi-3 rotates part of each head
    with its LongRoPE: test_phi3_longrope_short_factors.)"""
    model = tiny_model(family, head_dim=16, rope_parameters={
        "rope_type": "linear", "factor": 2.0, "rope_theta": 1e4, "partial_rotary_factor": 0.5})
    with pytest.raises(ValueError, match=r"^partial_rotary_factor: 0\.5 .*rope_type 'linear'"):
        Engine(model, EngineConfig(kv_cache_tokens=1024, max_model_len=128))


@pytest.mark.parametrize("flag", ["attention_bias", "mlp_bias"])
def test_mistral_has_no_biases_whatever_its_config_says(flag):
    """transformers' Mistral builds no bias whatever attention_bias and mlp_bias hold; the
    engine built them and refused the model ("the checkpoint lacks ... o_proj.bias")."""
    generate(tiny_model("mistral", **{flag: True}))


def test_qwen2_sliding_layers_from_max_window_layers():
    """Qwen2 with use_sliding_window: layers from max_window_layers on slide, the others not."""
    model = tiny_model("qwen2", num_hidden_layers=3, use_sliding_window=True, sliding_window=6,
                       max_window_layers=1)
    engine, _ = generate(model)
    assert engine.model.kv_layout.windows == (None, 6, 6)


def longrope(head_dim=16, factor=1.0):
    half = int(head_dim * factor) // 2
    return {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": factor,
            "short_factor": [1.0 + 0.1 * i for i in range(half)],
            "long_factor": [1.0 + 0.7 * i for i in range(half)]}


@pytest.mark.parametrize("factor", [1.0, 0.5])
def test_phi3_longrope_short_factors(factor):
    """max_model_len within original_max_position_embeddings (32): the short factors, as the
    reference uses for sequences that long; partial rotary (Phi-4-mini) too."""
    model = tiny_model("phi3", rope_parameters=longrope(factor=factor),
                       original_max_position_embeddings=32, max_position_embeddings=128)
    prompts = [list(range(3, 15)), [9, 8, 7], [42] * 10]
    generate(model, prompts, max_tokens=12, max_model_len=32)


# Both follow each forward's length in the reference (LongRoPE's long factors past
# original_max_position_embeddings, dynamic NTK's base past max_position_embeddings); the
# engine's table, built once for max_model_len, held the long (rescaled) frequencies for every
# sequence: short prompts' greedy tokens differed from their first ones.
@pytest.mark.parametrize("family, config, field", [
    ("phi3", {"rope_parameters": longrope(), "original_max_position_embeddings": 32,
              "max_position_embeddings": 128}, "original_max_position_embeddings=32"),
    ("llama", {"rope_parameters": {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 1e4},
               "max_position_embeddings": 32}, "max_position_embeddings=32"),
])
def test_a_length_dependent_rope_is_served_only_as_far_as_one_table_matches(family, config,
                                                                            field):
    """One token past the length up to which the reference uses one set of frequencies for
    every sequence: a ValueError naming max_model_len, the field and the rope_type; up to it
    (the default max_model_len too), parity."""
    model = tiny_model(family, **config)
    rope_type = config["rope_parameters"]["rope_type"]
    with pytest.raises(ValueError, match=rf"^max_model_len: 33 .*{field}\b.*"
                                         rf"rope_type '{rope_type}'"):
        Engine(model, EngineConfig(kv_cache_tokens=1024, max_model_len=33))
    assert Engine(model, EngineConfig(kv_cache_tokens=1024)).config.max_model_len == 32
    generate(model, [list(range(3, 15)), [9, 8, 7], [42] * 10], max_tokens=12,
             max_model_len=32)


@pytest.mark.parametrize("family", ["gemma2", "gemma3_text"])
def test_chunked_prefill_over_a_window_gives_the_same_tokens(family):
    model = tiny_model(family)
    _, big = generate(model)
    _, small = generate(model, max_num_batched_tokens=5, max_num_seqs=2)
    assert [o.samples[0].token_ids for o in big] == [o.samples[0].token_ids for o in small]


# --- the context a config declares --------------------------------------------------------
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16, "rope_theta": 500000.0}


@pytest.mark.parametrize("family, config, length", [
    ("llama", {}, 64),
    # linear scaling stretches max_position_embeddings by its factor, YaRN the original length
    # by its factor; Llama 3's max_position_embeddings is the extended one. (Dynamic NTK and
    # LongRoPE: the test above.)
    ("llama", {"rope_parameters": {"rope_type": "linear", "factor": 2.0}}, 128),
    ("llama", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, 256),  # (Qwen2.5's)
    ("llama", {"rope_parameters": LLAMA3}, 64),
    # per layer type: the shortest (Gemma 3's global layers scaled linearly, local ones not)
    ("gemma3_text", {}, 64),
])
def test_max_model_len_past_the_declared_context_is_refused(family, config, length):
    """max_model_len up to the context the model's config declares (max_position_embeddings,
    as its RoPE scaling extends it) builds; one token more is a ValueError naming the field
    and both lengths, as vLLM refuses it."""
    model = tiny_model(family, **{"max_position_embeddings": 64, **config})
    Engine(model, EngineConfig(kv_cache_tokens=1024, max_model_len=length))
    positions = model.config.max_position_embeddings
    with pytest.raises(ValueError, match=rf"^max_model_len: {length + 1} .*"
                                         rf"max_position_embeddings={positions}\b"):
        Engine(model, EngineConfig(kv_cache_tokens=1024, max_model_len=length + 1))


@pytest.mark.parametrize("positions, want", [(64, 64), (8192, 4096)])
def test_default_max_model_len_fits_the_model(positions, want):
    """max_model_len left out: 4096, or the model's context where that is shorter."""
    model = tiny_model("qwen2", max_position_embeddings=positions)
    engine = Engine(model, EngineConfig(kv_cache_tokens=4096))
    assert engine.config.max_model_len == want
    out = engine.generate([[3, 4, 5]], SamplingParams(temperature=0, max_tokens=70,
                                                       ignore_eos=True))
    assert len(out[0].samples[0].token_ids) == min(70, want - 3)


# --- the contract ---------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_weight_table_covers_the_checkpoint_exactly(family):
    """Every HF tensor lands somewhere, and everything expected is written once."""
    model = tiny_model(family)
    ours = build_model(model.config, 64, torch.float32, torch.device("cpu"))
    named = list(model_tensors(model))
    written = ours.load_weights(named)
    assert written == ours.expected_weight_names()
    for name, tensor in named:  # e.g. q_proj -> a shard of qkv_proj; Phi-3's qkv_proj whole
        target, shard = ours.WEIGHTS.target(name)
        param = ours.get_parameter(target)
        if shard is None:
            assert torch.equal(param, tensor)


def test_every_family_is_registered_and_unknown_ones_refused():
    for family in FAMILIES:
        assert family in MODEL_REGISTRY
    with pytest.raises(ValueError, match="model_type 'gpt2' is not supported"):
        model_class(type("Config", (), {"model_type": "gpt2"})())


def test_engine_reaches_models_only_through_the_contract():
    """Outside rollout/models, nothing reads a model's internals (its submodules, rope, head,
    head counts): the KV layout, dtype, tables, forward and logits are the interface."""
    root = pathlib.Path(__file__).parents[2] / "rollout"
    internals = {"model", "rope", "lm_head", "num_kv_heads", "head_dim", "embed_tokens",
                 "layers"}
    offenders = []
    for path in root.rglob("*.py"):
        if "models" in path.relative_to(root).parts:
            continue
        # Code only (strings and comments name HF checkpoint paths): `model.<internal>`.
        toks = [t for t in tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
                if t.type in (tokenize.NAME, tokenize.OP)]
        for a, dot, b in zip(toks, toks[1:], toks[2:]):
            if a.string == "model" and dot.string == "." and b.string in internals:
                offenders.append(f"{path.relative_to(root)}:{a.start[0]}")
    assert not offenders
