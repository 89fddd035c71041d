"""SamplingParams.top_logprobs (and vLLM's logprobs=k): each generated token's k most likely
alternatives under log_softmax(logits / T), against a float64 transformers forward; unchanged by
speculative verification (drafts accepted), preemption and truncated sampling. The bound is
twice transformers' own float32 distance to the float64 answer (tests/support/floors.py)."""

import pytest
import torch
from floors import exact_copy, tolerance
from models import tiny_model

from rollout import Engine, EngineConfig, SamplingParams, SpeculativeConfig

PROMPTS = [[1, 2, 3, 4, 5] * 3, [7, 8, 9], list(range(10, 40))]


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen2")


def engine(model, **kw):
    return Engine(model, EngineConfig(**(dict(kv_cache_tokens=2048, max_model_len=160) | kw)))


@torch.no_grad()
def reference(model, prompt, tokens, temperature):
    seq = torch.tensor([prompt + tokens])
    logits = model(seq).logits[0, len(prompt) - 1:-1].double()
    return (logits / (temperature or 1.0)).log_softmax(-1)


def tokens(outs):
    return [s.token_ids for o in outs for s in o.samples]


def check(model, outs, temperature, k):
    exact = exact_copy(model)
    for o in outs:
        for s in o.samples:
            want = reference(exact, o.prompt_token_ids, s.token_ids, temperature).topk(k, -1)
            own = reference(model, o.prompt_token_ids, s.token_ids, temperature).topk(k, -1)
            tol = tolerance((own.values - want.values).abs().max().item(), want.values)
            assert s.top_logprobs.ids.shape == (len(s.token_ids), k)
            assert torch.equal(s.top_logprobs.ids, want.indices)
            assert (s.top_logprobs.logprobs.double() - want.values).abs().max() <= tol
            # The sampled token's own logprob, when among the alternatives, is the same number.
            for j, t in enumerate(s.token_ids):
                if t in s.top_logprobs[j]:
                    assert s.top_logprobs[j][t] == pytest.approx(s.logprobs[j], abs=1e-6)


@pytest.mark.parametrize("temperature, top_p", [(0, 1.0), (0.8, 1.0), (1.0, 0.7)])
def test_alternatives_equal_the_reference(model, temperature, top_p):
    params = SamplingParams(n=2, max_tokens=12, temperature=temperature, top_p=top_p, seed=4,
                            top_logprobs=5)
    check(model, engine(model).generate(PROMPTS, params), temperature, 5)


def test_vllm_style_logprobs_k(model):
    p = SamplingParams(logprobs=3)
    assert p.logprobs is True and p.top_logprobs == 3
    p = SamplingParams(logprobs=0)  # vLLM: the sampled token's logprob, no alternatives
    assert p.logprobs is True and p.top_logprobs == 0
    assert SamplingParams(top_logprobs=2).logprobs is True
    out = engine(model).generate([[1, 2, 3]], SamplingParams(max_tokens=4, logprobs=0))
    assert out[0].samples[0].top_logprobs is None and len(out[0].samples[0].logprobs) == 4
    with pytest.raises(ValueError, match="top_logprobs must be at most the vocabulary"):
        engine(tiny_model("qwen2", vocab_size=16)).generate(
            [[1, 2]], SamplingParams(top_logprobs=17))


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_speculation_changes_no_alternative(model, method):
    """A draft model equal to the target accepts every draft: tokens from verify rows carry the
    same alternatives as plain decoding."""
    params = SamplingParams(n=2, max_tokens=20, temperature=0.9, seed=5, top_logprobs=3)
    plain = engine(model).generate(PROMPTS, params)
    spec = engine(model, speculative=SpeculativeConfig(method, num_speculative_tokens=4,
                                                       draft_model=model))
    outs = spec.generate(PROMPTS, params)
    assert spec.stats.spec_accepted > 0
    assert tokens(outs) == tokens(plain)
    check(model, outs, 0.9, 3)


def test_preemption_keeps_the_alternatives(model):
    params = SamplingParams(n=4, max_tokens=40, temperature=1.0, seed=6, top_logprobs=2,
                            ignore_eos=True)
    big = engine(model).generate(PROMPTS, params)
    small = engine(model, kv_cache_tokens=160, max_num_batched_tokens=32)
    outs = small.generate(PROMPTS, params)
    assert small.stats.preemptions > 0
    assert tokens(outs) == tokens(big)
    check(model, outs, 1.0, 2)
    small.check_invariants()
