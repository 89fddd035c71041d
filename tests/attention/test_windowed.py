"""The engine on sliding-window models (Gemma 2/3: windowed layers interleaved with global ones,
window 8, shorter than the prompts): the torch backend's shared-prefix split with per-layer
windows against the reference, the Triton backend against the torch one, speculative decoding,
preemption, sleep/wake and graphed decode."""

import dataclasses

import pytest
from helpers import run_checked, samples
from kernels_env import DEVICE
from models import tiny_model
from reference import assert_matches_reference
from test_torch_shared_prefix import MIXED, assert_attention_exact, make_step, random_pool

from rollout import Engine, EngineConfig, SamplingParams
from rollout.attention import triton as triton_attention
from rollout.attention.sdpa import TorchAttention
from rollout.spec import SpeculativeConfig
from rollout_kernels.triton import paged_attention_ref

PROMPTS = [list(range(3, 30)), [5, 6, 7], list(range(40, 52)), [9, 9, 8, 9, 9, 8] * 3]


def engine(family="gemma2", model=None, **overrides) -> Engine:
    config = dict(kv_cache_tokens=1024, max_model_len=96)
    config.update(overrides)
    return Engine(model or tiny_model(family).to(DEVICE), EngineConfig(**config))


def logprob_close(a, b, tol=1e-4):
    for x, y in zip(a, b, strict=True):
        for sx, sy in zip(x.samples, y.samples, strict=True):
            assert sx.token_ids == sy.token_ids
            assert max(abs(p - q) for p, q in zip(sx.logprobs, sy.logprobs)) < tol


@pytest.mark.parametrize("window", [4, 30])
def test_torch_backend_windows_per_layer_with_the_shared_prefix_split(window):
    """Layer 0 slides, layer 1 is global; the step mixes decode and verify rows of sample
    groups, prefills and extends (tests/attention/test_torch_shared_prefix.py). Each layer's output
    equals the reference with that layer's window; the global layer keeps the split."""
    pool = random_pool(2, 2, 64)
    meta, q, k, v = make_step(pool, MIXED, num_q_heads=4, seed=2)
    backend = TorchAttention(pool, windows=[window, None])
    meta.plan = backend.plan(meta)
    assert meta.plan.shared is not None
    windowed = meta.plan.by_window[window]
    assert (windowed is meta.plan) == (window >= meta.max_kv_len)
    scale = 64 ** -0.5
    for layer, w in enumerate(backend.windows):
        out = backend.forward(q, k, v, layer, meta, scale)
        ref = paged_attention_ref(q, pool.k(layer), pool.v(layer), meta.qo_indptr,
                                  meta.kv_indptr, meta.kv_indices, scale, window=w)
        assert_attention_exact(out, pool, meta, q, layer, window=w, floor=ref)
    # Rows whose context fits in the window keep the split even in the windowed layer.
    if windowed.shared is not None:
        fits = [b for b, n in enumerate(meta.kv_lens) if n <= window]
        assert fits


def test_torch_backend_softcap_on_both_paths():
    pool = random_pool(1, 2, 64)
    meta, q, k, v = make_step(pool, MIXED, num_q_heads=4, seed=3)
    backend = TorchAttention(pool)
    plain = dataclasses.replace(meta, groups=[], shared_lens=[])
    for m in (meta, plain):
        m.plan = backend.plan(m)
        out = backend.forward(q * 3, k, v, 0, m, 0.125, softcap=1.5)
        ref = paged_attention_ref(q * 3, pool.k(0), pool.v(0), m.qo_indptr, m.kv_indptr,
                                  m.kv_indices, 0.125, softcap=1.5)
        assert_attention_exact(out, pool, m, q * 3, softcap=1.5, floor=ref)


@pytest.mark.interpreter
@pytest.mark.parametrize("family", ["gemma2", "gemma3_text"])
def test_triton_backend_matches_torch_backend_with_windows(family, monkeypatch):
    """Per-layer windows and soft-capping in the paged kernel; n = 2 samples per prompt decode
    through the shared-prefix kernel in the global layers only (contexts pass the window)."""
    calls = []

    def counted(name, kernel):
        def call(*args, **kwargs):
            calls.append((name, kwargs.get("window")))
            return kernel(*args, **kwargs)
        monkeypatch.setattr(triton_attention, name, call)

    counted("paged_attention", triton_attention.paged_attention)
    counted("shared_prefix_attention", triton_attention.shared_prefix_attention)
    params = SamplingParams(n=2, temperature=0.8, max_tokens=6, logprobs=True, seed=1)
    outs = [run_checked(engine(family, backend=b, max_num_batched_tokens=9), PROMPTS[:3],
                        params) for b in ("torch", "triton")]
    logprob_close(*outs)
    assert ("paged_attention", 8) in calls and ("shared_prefix_attention", None) in calls


@pytest.mark.interpreter
def test_graphed_decode_of_a_windowed_model_matches_eager():
    params = SamplingParams(n=2, temperature=0.8, max_tokens=5, logprobs=True, seed=2)
    graphed = engine(backend="triton", cuda_graphs=True, max_num_seqs=4)
    outs = [run_checked(e, PROMPTS[:1], params) for e in (engine(backend="triton"), graphed)]
    logprob_close(*outs)
    assert graphed.stack.graphs.replays > 0


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_speculative_decoding_on_a_windowed_model(method):
    """Verify rows attend through the window; greedy outputs unchanged, and they match
    transformers. The draft is itself a windowed model (Gemma 3)."""
    draft = tiny_model("gemma3_text", seed=1, num_hidden_layers=2) if method == "draft" else None
    spec = SpeculativeConfig(method, num_speculative_tokens=3, draft_model=draft)
    params = SamplingParams(n=2, temperature=0, max_tokens=20, logprobs=True)
    model = tiny_model("gemma2")
    plain = run_checked(engine(model=model), PROMPTS, params)
    speculating = engine(model=model, speculative=spec)
    outs = run_checked(speculating, PROMPTS, params)
    assert samples(outs) == samples(plain)
    assert speculating.stats.spec_proposed > 0
    assert_matches_reference(model, PROMPTS, outs)


def test_seeded_speculation_keeps_samples_on_a_windowed_model():
    params = SamplingParams(n=3, temperature=1.0, max_tokens=16, logprobs=True, seed=4)
    spec = SpeculativeConfig("ngram", num_speculative_tokens=3)
    logprob_close(run_checked(engine(), PROMPTS, params),
                  run_checked(engine(speculative=spec), PROMPTS, params))


def test_preemption_on_a_windowed_model_gives_the_same_samples():
    """A pool of 96 slots for 4 prompts x 3 samples growing to ~50 tokens: preempted
    sequences come back through the prefix cache, their windowed layers included."""
    params = SamplingParams(n=3, temperature=0.9, max_tokens=24, logprobs=True, seed=6,
                            ignore_eos=True)
    roomy = run_checked(engine(), PROMPTS, params)
    tight = engine(kv_cache_tokens=96)
    outs = run_checked(tight, PROMPTS, params)
    assert tight.stats.preemptions > 0
    logprob_close(roomy, outs)


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_and_wake_on_a_windowed_model(level):
    model = tiny_model("gemma3_text")
    eng = engine(model=model)
    params = SamplingParams(n=2, temperature=0, max_tokens=12, logprobs=True)
    first = eng.generate(PROMPTS, params)
    assert_matches_reference(model, PROMPTS, first)
    eng.sleep(level)
    assert all(not m.has_table for m in eng.model.modules() if hasattr(m, "has_table"))
    eng.wake_up()
    if level == 2:
        eng.update_weights(model)
    second = eng.generate(PROMPTS, params)
    eng.check_invariants()
    logprob_close(first, second, tol=1e-6)
