"""Engine.score against transformers' own forward (float64 as the exact answer, the bound from
transformers' float32 distance to it), prefix sharing counted, the cached prompt reused,
sequences longer than a chunk, preemption, bad input, top-k alternatives."""

import copy

import pytest
import torch
from floors import exact_copy, tolerance
from models import tiny_model

from rollout import Engine, EngineConfig, SamplingParams


def rand(n, seed, vocab=128):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def family(request):
    return request.param


@pytest.fixture(scope="module")
def models(family):
    model = tiny_model(family)
    return model, exact_copy(model)


@torch.no_grad()
def logp(model, seq, temperature=1.0):
    """log_softmax(logits / T) of tokens 1.. of `seq`, float64, [L - 1, V]."""
    logits = model(torch.tensor([seq])).logits[0, :-1].double()
    return (logits / temperature).log_softmax(-1)


def at_tokens(full, seq):
    return full.gather(-1, torch.tensor(seq[1:])[:, None])[:, 0]


def bound(models, seqs, temperature=1.0):
    """Twice transformers' own float32 distance to the float64 answer (or 8 ulps)."""
    model, exact = models
    floor = max((at_tokens(logp(model, s, temperature), s)
                 - at_tokens(logp(exact, s, temperature), s)).abs().max().item()
                for s in seqs if len(s) > 1)
    values = torch.cat([at_tokens(logp(exact, s, temperature), s) for s in seqs if len(s) > 1])
    return tolerance(floor, values)


def engine(model, **kw):
    cfg = dict(kv_cache_tokens=4096, max_model_len=256, max_num_batched_tokens=64)
    cfg.update(kw)
    return Engine(model, EngineConfig(**cfg))


def check_against_exact(models, seqs, outs, temperature=1.0, starts=None):
    exact = models[1]
    tol = bound(models, seqs, temperature)
    for i, (s, o) in enumerate(zip(seqs, outs)):
        start = 1 if starts is None else starts[i]
        want = at_tokens(logp(exact, s, temperature), s)[start - 1:]
        assert o.token_ids == s and o.start == start and len(o.logprobs) == len(s) - start
        if len(want):
            got = torch.tensor(o.logprobs, dtype=torch.float64)
            assert (got - want).abs().max().item() <= tol, (i, (got - want).abs().max(), tol)


def test_equals_transformers_with_shared_prefixes_and_long_sequences(models):
    """Four completions of one prompt, a sequence of 3+ chunks, duplicates, a sequence that is a
    prefix of another, one token: the float64 answer within the floor; the shared rows are
    computed once (counted exactly)."""
    prompt = rand(40, 1)
    completions = [prompt + rand(20, 10 + i) for i in range(4)]
    seqs = [*completions, rand(150, 2), completions[1], prompt[:25], [7]]
    eng = engine(models[0])
    outs = eng.score(seqs)
    check_against_exact(models, seqs, outs)
    st = eng.stats
    assert st.scored_tokens == sum(len(s) - 1 for s in seqs)
    # The first completion runs its 59 positions; the other three only their own 20 (the
    # position before the first token they do not share runs again: rows are not K/V); the
    # long one its 149; the duplicate and the prefix nothing (their rows are all known).
    leader = min(completions)  # sorted first
    firsts = [next(k for k in range(60) if c[k] != leader[k]) for c in completions
              if c is not leader]
    assert st.score_tokens_computed == 59 + sum(59 - (f - 1) for f in firsts) + 149
    assert outs[5].logprobs == outs[1].logprobs  # copied, the same numbers
    assert outs[6].logprobs == outs[0].logprobs[:24]
    eng.check_invariants()


def test_start_reuses_the_cached_prompt_and_matches_generation(models):
    """score(start=len(prompt)) after generate: the prompt's K/V comes from the cache and the
    completion's logprobs equal generation's (temperature as sampled)."""
    eng = engine(models[0])
    prompts = [rand(30, 3), rand(45, 4)]
    params = SamplingParams(n=2, max_tokens=24, temperature=0.7, logprobs=True, seed=2)
    outs = eng.generate(prompts, params)
    seqs = [o.prompt_token_ids + s.token_ids for o in outs for s in o.samples]
    starts = [len(o.prompt_token_ids) for o in outs for _ in o.samples]
    hits, computed = eng.stats.cache_hit_tokens, eng.stats.score_tokens_computed
    scored = eng.score(seqs, temperature=0.7, start=starts)
    check_against_exact(models, seqs, scored, 0.7, starts)
    assert eng.stats.score_tokens_computed - computed == sum(len(s) - p for s, p in
                                                             zip(seqs, starts))
    assert eng.stats.cache_hit_tokens - hits == sum(p - 1 for p in starts)
    gen = [lp for o in outs for s in o.samples for lp in s.logprobs]
    got = [lp for o in scored for lp in o.logprobs]
    tol = bound(models, seqs, 0.7)
    assert max(abs(a - b) for a, b in zip(gen, got)) <= 2 * tol


def test_top_logprobs_and_temperature(models):
    model, exact = models
    seqs = [rand(30, 5), rand(12, 6)]
    outs = engine(model).score(seqs, temperature=1.3, top_logprobs=5)
    tol = bound(models, seqs, 1.3)
    for s, o in zip(seqs, outs):
        full = logp(exact, s, 1.3)
        top = full.topk(5, dim=-1)
        assert o.top.ids.shape == (len(s) - 1, 5) and len(o.top) == len(s) - 1
        # Ties aside (none at this size), the same ids in the same order.
        assert torch.equal(o.top.ids, top.indices)
        assert (o.top.logprobs.double() - top.values).abs().max().item() <= tol
        assert o.top[0] == dict(zip(o.top.ids[0].tolist(), o.top.logprobs[0].tolist()))


def test_preempted_while_scoring(models):
    """Scoring beside streaming requests in a pool too small for both: preempted sequences
    (scored or sampled) resume; the scores equal a large pool's, the samples an engine's that
    never scored."""
    seqs = [rand(100, 20 + i) for i in range(3)]
    big = engine(models[0]).score(seqs)
    params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)

    def streamed(eng, score):
        for p in ([1, 2, 3], [4, 5, 6]):
            eng.add_request(p, params)
        for _ in range(100):
            eng.step()
        scored = eng.score(seqs) if score else None
        outs = []
        while eng.has_unfinished:
            outs += eng.step()
        return scored, sorted((o.request_id, o.samples[0].token_ids) for o in outs)

    small = engine(models[0], kv_cache_tokens=256, max_num_batched_tokens=32)
    outs, sampled = streamed(small, True)
    assert small.stats.preemptions > 0
    assert sampled == streamed(engine(models[0], kv_cache_tokens=256), False)[1]
    tol = bound(models, seqs)
    for a, b in zip(big, outs):
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) <= tol
    small.check_invariants()


@pytest.mark.parametrize("kwargs, match", [
    (dict(sequences="abc"), "sequences must be a list"),
    (dict(sequences=[[]]), r"sequences\[0\]: empty"),
    (dict(sequences=[[1, 2], [3, 999]]), r"sequences\[1\]: token id 999 is outside"),
    (dict(sequences=[[1.5, 2]]), r"sequences\[0\]: token id must be an int"),
    (dict(sequences=[list(range(100))] * 2 + [[1] * 300]), "300 tokens, more than max_model_len"),
    (dict(sequences=["ab"]), "a string needs a tokenizer"),
    (dict(temperature=0), "temperature must be in"),
    (dict(temperature=float("nan")), "temperature must be a finite"),
    (dict(top_logprobs=21), "top_logprobs must be"),
    (dict(top_logprobs=-1), "top_logprobs must be"),
    (dict(start=0), r"start\[0\] must be"),
    (dict(start=4), r"start\[0\] must be at most the sequence's length 3"),
    (dict(start=[1, 2]), "start: 2 values for 1 sequences"),
])
def test_bad_input_is_refused_and_the_engine_keeps_working(models, kwargs, match):
    eng = engine(models[0])
    rid = eng.add_request([1, 2, 3], SamplingParams(max_tokens=5, temperature=0))
    args = dict(sequences=[[1, 2, 3]]) | kwargs
    with pytest.raises(ValueError, match=match):
        eng.score(**args)
    assert eng.running_requests == [rid]
    outs = []
    while eng.has_unfinished:
        outs += eng.step()
    assert len(outs[0].samples[0].token_ids) == 5
    assert eng.score([[1, 2, 3]])[0].logprobs == engine(models[0]).score([[1, 2, 3]])[0].logprobs


def test_start_as_a_tensor_or_an_array(models):
    import numpy as np

    eng = engine(models[0])
    seqs = [[1, 2, 3, 4], [5, 6, 7]]
    want = [(o.start, o.logprobs) for o in eng.score(seqs, start=[1, 2])]
    for start in (torch.tensor([1, 2]), np.array([1, 2])):
        assert [(o.start, o.logprobs) for o in eng.score(seqs, start=start)] == want
    with pytest.raises(ValueError, match="start: 3 values for 2 sequences"):
        eng.score(seqs, start=torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match=r"start\[0\] must be an int"):
        eng.score(seqs, start=np.array([1.5, 2.0]))


def test_scoring_draws_no_seed_and_leaves_the_cache_consistent(models):
    """A score call between two rollouts shifts no later seed; unseeded samples after it equal
    those of an engine that never scored."""
    params = SamplingParams(n=2, max_tokens=10)
    a, b = engine(models[0], seed=7), engine(models[0], seed=7)
    a.score([rand(40, 8), rand(40, 9)])
    got = a.generate([rand(20, 8)], params)
    want = b.generate([rand(20, 8)], params)
    assert [s.token_ids for s in got[0].samples] == [s.token_ids for s in want[0].samples]
    a.check_invariants()


def test_non_finite_logits_fail_that_sequence_alone():
    """Token 127's embedding is NaN (an untied head): the sequence holding it gets an error and
    no logprobs (its K/V is not cached); the other sequence of the same step is scored."""
    model = tiny_model("llama")
    poisoned_model = copy.deepcopy(model)
    with torch.no_grad():
        poisoned_model.get_input_embeddings().weight[127] = float("nan")
    eng = engine(poisoned_model)
    poisoned = [p % 127 for p in rand(30, 11)] + [127] + rand(5, 12, vocab=127)
    clean = rand(8, 13, vocab=127)
    outs = eng.score([poisoned, clean])
    assert outs[0].logprobs is None and "non-finite" in outs[0].error
    assert outs[1].error is None
    assert outs[1].logprobs == engine(model).score([clean])[0].logprobs
    assert eng.cached_prefix_len(poisoned) == 0  # its K/V is not shared
    eng.check_invariants()
