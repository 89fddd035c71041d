"""SamplingParams.top_logprobs (and vLLM's logprobs=k): each generated token's k most likely
alternatives under log_softmax(logits / T), against a float64 transformers forward; unchanged by
speculative verification (drafts accepted), preemption and truncated sampling. The bound is
twice transformers' own float32 distance to the float64 answer (tests/support/floors.py).
Tied values come by ascending token id (rollout/sample/ranked.py), against a sort by (value,
id), whatever k the rest of a step asks for."""

import pytest
import torch
from floors import exact_copy, tolerance
from kernels_env import DEVICE
from models import tiny_model

from rollout import Engine, EngineConfig, SamplingParams, SpeculativeConfig
from rollout.sample.ranked import top_ranked

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
    """logprobs=k asks for k alternatives as top_logprobs=k does; the caller's object keeps
    what it was given, so a later logprobs=False turns both off (the engine reads k as
    top_logprobs in its own copy only)."""
    gen = engine(model)

    def shapes(params):
        s = gen.generate([[1, 2, 3]], params)[0].samples[0]
        return (None if s.logprobs is None else len(s.logprobs),
                None if s.top_logprobs is None else tuple(s.top_logprobs.ids.shape))

    p = SamplingParams(max_tokens=4, logprobs=3)
    assert p.logprobs == 3 and p.top_logprobs == 0
    assert shapes(p) == (4, (4, 3)) and p.logprobs == 3  # the engine's copy, not the caller's
    p.logprobs = False
    assert shapes(p) == (None, None)
    p.logprobs = 2
    assert shapes(p) == (4, (4, 2))
    assert shapes(SamplingParams(max_tokens=4, logprobs=0)) == (4, None)  # vLLM: no alternatives
    assert shapes(SamplingParams(max_tokens=4, top_logprobs=2)) == (4, (4, 2))
    assert shapes(SamplingParams(max_tokens=4, logprobs=2, top_logprobs=2)) == (4, (4, 2))
    with pytest.raises(ValueError, match="logprobs=2 asks for 2 alternatives but top_logprobs=3"):
        SamplingParams(logprobs=2, top_logprobs=3)
    with pytest.raises(ValueError, match="top_logprobs must be at most the vocabulary"):
        engine(tiny_model("qwen2", vocab_size=16)).generate(
            [[1, 2]], SamplingParams(top_logprobs=17))
    with pytest.raises(ValueError, match="^logprobs must be at most the vocabulary"):
        engine(tiny_model("qwen2", vocab_size=16)).generate(
            [[1, 2]], SamplingParams(logprobs=17))


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_speculation_changes_no_alternative(model, method):
    """A draft model equal to the target accepts every draft: tokens from verify rows carry the
    same alternatives as plain decoding. (At 0.3 the tiny model repeats itself enough for the
    n-gram drafter to be accepted whatever the seed: 2-13 drafts over seeds 0-7, where at 0.9
    some seeds' samples never are.)"""
    params = SamplingParams(n=2, max_tokens=20, temperature=0.3, seed=5, top_logprobs=3)
    plain = engine(model).generate(PROMPTS, params)
    spec = engine(model, speculative=SpeculativeConfig(
        method, num_speculative_tokens=4, draft_model=model if method == "draft" else None))
    outs = spec.generate(PROMPTS, params)
    assert spec.stats.spec_accepted > 0
    assert tokens(outs) == tokens(plain)
    check(model, outs, 0.3, 3)


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


def naive_ranked(row: torch.Tensor, k: int) -> list[int]:
    return sorted(range(len(row)), key=lambda t: (-row[t].item(), t))[:k]


@pytest.mark.parametrize("kind", ["grid", "normal", "masked"])
def test_ranked_rows_against_a_sort_by_value_then_id(kind):
    """Rows on a 6-value grid (ties at every rank), distinct values, and -inf tails: the ids
    and values a sort by (-value, id) gives, for every k; a row's first j of any k >= j agree."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(12, 300, generator=gen)
    if kind == "grid":
        x = torch.randint(0, 6, (12, 300), generator=gen).float()
    if kind == "masked":
        x[:, 5:] = float("-inf")
    logp = x.log_softmax(dim=-1)
    for k in (0, 1, 4, 20, 300):
        ids, values = (t.cpu() for t in top_ranked(logp.to(DEVICE), k))  # CUDA where there is one
        for i, row in enumerate(logp):
            want = naive_ranked(row, k)
            assert ids[i].tolist() == want
            assert torch.equal(values[i], row[want])
        assert torch.equal(top_ranked(logp, 20)[0][:, :min(k, 20)], ids[:, :20])


def test_a_row_with_nan_keeps_topk_and_the_others_their_order():
    logp = torch.randint(0, 3, (3, 50), generator=torch.Generator().manual_seed(1)).float()
    logp[1, 7] = float("nan")
    ids, values = top_ranked(logp, 5)
    assert ids[1].tolist() == logp[1].topk(5).indices.tolist()
    for i in (0, 2):
        assert ids[i].tolist() == naive_ranked(logp[i], 5)


def test_alternatives_do_not_depend_on_what_others_ask():
    """A head whose rows come in equal pairs (every logit tied with another): a request's two
    alternatives alone are those it gets beside a request asking for twenty, the lower id of a
    tied pair first; Engine.score's alike."""
    model = tiny_model("llama", seed=2)
    with torch.no_grad():
        weight = model.get_output_embeddings().weight
        weight[64:128] = weight[0:64]
    a = SamplingParams(max_tokens=8, temperature=0.9, seed=1, top_logprobs=2, ignore_eos=True)
    b = SamplingParams(max_tokens=8, temperature=0.9, seed=2, top_logprobs=20, ignore_eos=True)
    alone = engine(model).generate([PROMPTS[0]], a)[0].samples[0]
    together = engine(model).generate([PROMPTS[0], PROMPTS[1]], [a, b])[0].samples[0]
    assert together.token_ids == alone.token_ids
    assert torch.equal(together.top_logprobs.ids, alone.top_logprobs.ids)
    first, second = alone.top_logprobs.ids.T  # the top two: a tied pair, the lower id first
    assert (first < 64).all() and torch.equal(second, first + 64)
    seq = PROMPTS[0] + alone.token_ids
    scored = [engine(model).score([seq], top_logprobs=k)[0].top.ids[:, :2]
              for k in (2, 20)]
    assert torch.equal(scored[0], scored[1])
