"""The distribution a token was drawn from (rollout/sample/support.py): `sampling_logprobs` against
a naive float64 reference (tests/support/filter_reference.py) for every truncation and
their combinations and temperatures, ties at the boundary; the support against the reference's
kept set; the sampled tokens' frequencies against exp(sampling_logprobs) (chi-square), with
and without speculative verification; `logprobs_on_support` and its gradients against a naive
masked log-softmax; and the engine's samples carrying both."""

import itertools
import math

import numpy as np
import pytest
import torch
from filter_reference import reference
from floors import assert_as_exact_as
from kernels_env import device_for
from models import tiny_model
from scipy import stats

from rollout import Engine, EngineConfig, SamplingParams, Support, logprobs_on_support
from rollout.ops.backend import resolve_backend
from rollout.sample.sampler import Sampler, SamplingBatch
from rollout.spec.verify import verify
from rollout_kernels import cpu as native

VOCAB = 300
CPU = torch.device("cpu")
# The fused Triton sampler draws the token, the torch filter gives its support (sampler.py): on
# CUDA only (compiled), where the two must agree on every kept set.
SAMPLERS = ["torch"] + (["cpu"] if native.has("gumbel_argmax_f32") else []) + (
    ["triton"] if torch.cuda.is_available() else [])
SETTINGS = [  # temperature, top_k, top_p, min_p
    (1.0, 0, 0.8, 0.0), (0.7, 0, 0.95, 0.0), (1.0, 20, 1.0, 0.0), (1.3, 5, 1.0, 0.0),
    (1.0, 0, 1.0, 0.05), (0.9, 50, 0.9, 0.0), (1.0, 30, 0.8, 0.02), (0.6, 0, 0.5, 0.1),
    (1.0, 1, 1.0, 0.0), (1.0, 0, 1.0, 0.0), (0.8, 0, 1.0, 0.0),
]


def batch_of(rows: int, temperature, top_k, top_p, min_p, seed=0, device=CPU) -> SamplingBatch:
    return SamplingBatch.build([temperature] * rows, [top_k] * rows, [top_p] * rows,
                               [min_p] * rows, list(range(seed, seed + rows)),
                               [7] * rows, device)


def clear_of_boundaries(logits, setting) -> bool:
    """No reference decision within float32 rounding of its threshold (those rows may go
    either way; the ties test covers them)."""
    temperature, top_k, top_p, min_p = setting
    z = logits.double().numpy() / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    srt = np.sort(p)[::-1]
    k = top_k if top_k > 0 else len(p)
    q = srt[:k] / srt[:k].sum()
    before = np.cumsum(q) - q
    near_p = top_p < 1 and np.min(np.abs(before - top_p)) < 1e-4
    near_min = min_p > 0 and np.min(np.abs(p - min_p * srt[0])) < 1e-6 * srt[0]
    near_k = top_k > 0 and k < len(p) and srt[k - 1] - srt[k] < 1e-6
    return not (near_p or near_min or near_k)


def random_rows(n, setting, seed):
    gen = torch.Generator().manual_seed(seed)
    rows = []
    while len(rows) < n:
        row = torch.randn(VOCAB, generator=gen) * 3
        if clear_of_boundaries(row, setting):
            rows.append(row)
    return torch.stack(rows)


@pytest.mark.parametrize("backend", SAMPLERS)
@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: "T{}-k{}-p{}-m{}".format(*s))
def test_sampling_logprobs_and_support_are_the_reference_distributions(backend, setting):
    logits = random_rows(16, setting, seed=sum(map(hash, map(str, setting))) % 1000)
    device = device_for(backend)
    rows = batch_of(16, *setting, device=device)
    drawn = Sampler(resolve_backend(backend, device)).draw(logits.to(device), rows, (True,) * 16)
    truncated = setting[1] > 0 or setting[2] < 1 or setting[3] > 0
    for r, e in enumerate(drawn):
        kept, dist = reference(logits[r], *setting)
        (token,), (lp,), (slp,), (support,) = e.tokens, e.logprobs, e.sampling_logprobs, \
            e.supports
        assert token in kept
        want = np.log(dist[token])
        # float32 log-softmax and logsumexp of the kept values against float64: a few ulps of
        # the values involved (|logp| up to ~30 here).
        assert abs(slp - want) < 8 * 2 ** -23 * max(1.0, abs(want)) * 4, (slp, want)
        if truncated:
            assert set(support.tolist()) == kept
            assert support.dtype == torch.int32 and support.tolist() == sorted(kept)
        else:  # nothing cut: the whole vocabulary, and the sampling logprob is the logprob
            assert support is None and slp == lp


def test_greedy_rows_are_a_point_mass():
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(1))
    rows = SamplingBatch.build([0.0, 1.0, 0.0], [0, 0, 5], [1.0, 0.8, 0.5], [0.0] * 3,
                               [1, 2, 3], [0] * 3, CPU)
    drawn = Sampler(resolve_backend("torch", CPU)).draw(logits, rows, (True,) * 3)
    for r in (0, 2):
        assert drawn[r].tokens == (int(logits[r].argmax()),)
        assert drawn[r].sampling_logprobs == (0.0,)
        assert drawn[r].supports[0].tolist() == list(drawn[r].tokens)
    assert drawn[1].sampling_logprobs[0] < 0 < len(drawn[1].supports[0])


@pytest.mark.parametrize("backend", SAMPLERS)
def test_a_min_p_that_cuts_nothing_is_no_truncation(backend):
    """min-p cuts relative to each row's top token, so whether it cuts depends on the row: one
    whose every token lies above max + log(min_p) (a tiny min_p, or a flat row) is drawn from
    the whole vocabulary and reads as top_k = vocab or top_p = 1 do (sampling logprob = logprob,
    support 'all'), drawn or verified; a row it cuts keeps its truncated report."""
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(2)) * 3
    logits[1] = 0.5  # flat: every token is the top one
    min_p = [1e-30, 0.5, 0.05]
    device = device_for(backend)
    rows = SamplingBatch.build([1.0] * 3, [0] * 3, [1.0] * 3, min_p, [1, 2, 3], [7] * 3, device)
    drawn = Sampler(resolve_backend(backend, device)).draw(logits.to(device), rows, (True,) * 3)
    verified = verify(logits.to(device), rows, [[]] * 3, [None] * 3, want_support=(True,) * 3)
    for emitted in (drawn, verified):
        for r in (0, 1):
            assert list(emitted[r].supports) == [None]
            assert list(emitted[r].sampling_logprobs) == list(emitted[r].logprobs)
        kept, dist = reference(logits[2], 1.0, 0, 1.0, min_p[2])
        assert 0 < len(kept) < VOCAB and emitted[2].supports[0].tolist() == sorted(kept)
        (token,), (slp,) = emitted[2].tokens, emitted[2].sampling_logprobs
        assert slp == pytest.approx(np.log(dist[token]), abs=1e-5)
        assert slp > emitted[2].logprobs[0]


@pytest.mark.parametrize("backend", SAMPLERS)
def test_ties_at_the_boundary_are_kept_together_and_renormalised_over(backend):
    """Values tied across the top-k or top-p boundary: every tied token is kept (whatever
    the order a sort leaves them in), tokens are drawn from them alone, and the sampling
    logprob renormalises over the kept set."""
    row = torch.full((VOCAB,), -5.0)
    row[:3] = torch.tensor([4.0, 3.0, 2.5])
    row[10:20] = 2.0  # ten tokens tied where the 5th and 6th ranks fall
    device = device_for(backend)
    p = torch.softmax(row.double(), -1)
    # top_p 0.9: the mass above the tied tokens is 0.53 (kept), above the rest 0.99 (dropped).
    for setting in ((1.0, 5, 1.0, 0.0), (1.0, 8, 1.0, 0.0), (1.0, 0, 0.9, 0.0),
                    (1.0, 12, 0.9, 0.0)):
        kept_want, _ = reference(row, *setting)
        assert kept_want == {0, 1, 2, *range(10, 20)}
        drawn = Sampler(resolve_backend(backend, device)).draw(
            row.repeat(40, 1).to(device), batch_of(40, *setting, device=device), (True,) * 40)
        for e in drawn:
            assert set(e.supports[0].tolist()) == kept_want and e.tokens[0] in kept_want
            want = torch.log(p[e.tokens[0]] / p[sorted(kept_want)].sum()).item()
            assert abs(e.sampling_logprobs[0] - want) < 1e-6


def chi_square_p(tokens: list[int], probs: dict[int, float]) -> float:
    support = sorted(probs)
    counts = np.array([tokens.count(t) for t in support], dtype=float)
    expected = np.array([probs[t] for t in support]) * len(tokens)
    assert sum(counts) == len(tokens), "a token outside the support was drawn"
    big = expected >= 5  # pool the rare tokens into one bin
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return stats.chisquare(obs, exp).pvalue


@pytest.mark.parametrize("backend", SAMPLERS)
@pytest.mark.parametrize("setting", [(1.0, 0, 0.8, 0.0), (0.8, 12, 1.0, 0.0),
                                     (1.0, 0, 1.0, 0.1)], ids=["top_p", "top_k", "min_p"])
def test_tokens_are_drawn_with_the_sampling_probabilities(backend, setting):
    row = torch.randn(VOCAB, generator=torch.Generator().manual_seed(5)) * 1.5
    n = 6000
    device = device_for(backend)
    drawn = Sampler(resolve_backend(backend, device)).draw(
        row.repeat(n, 1).to(device), batch_of(n, *setting, device=device), (True,) * n)
    probs = {}
    for e in drawn:
        probs.setdefault(e.tokens[0], float(np.exp(e.sampling_logprobs[0])))
    kept, dist = reference(row, *setting)
    assert set(probs) <= kept
    full = {t: float(dist[t]) for t in kept}
    for t, p in probs.items():  # one distribution, whatever the row's seed
        assert abs(p - full[t]) < 1e-5
    assert chi_square_p([e.tokens[0] for e in drawn], full) > 1e-3


@pytest.mark.parametrize("rule", ["coupled", "rejection"])
def test_verification_emits_tokens_with_the_sampling_probabilities(rule):
    """Speculative verification with a draft at each of 2 positions: the first emitted token
    follows the target's truncated distribution, and the verdicts carry its sampling logprobs
    and supports."""
    gen = torch.Generator().manual_seed(8)
    target = torch.randn(2, VOCAB, generator=gen) * 1.5
    n = 4000
    setting = (1.0, 0, 0.8, 0.0)
    logits = target.repeat(n, 1)  # request i: rows 2i (its draft's position) and 2i + 1
    rows = SamplingBatch.build([1.0] * 2 * n, [0] * 2 * n, [0.8] * 2 * n, [0.0] * 2 * n,
                               [i // 2 for i in range(2 * n)], [3, 4] * n, CPU)
    draft_token = int(target[0].argmax())
    verdicts = verify(logits, rows, [[draft_token]] * n, [None] * n, rule,
                      want_support=(True,) * 2 * n)
    kept, dist = reference(target[0], *setting)
    first = [v.tokens[0] for v in verdicts]
    assert chi_square_p(first, {t: float(dist[t]) for t in kept}) > 1e-3
    for v in verdicts[:50]:
        assert set(v.supports[0].tolist()) == kept
        assert abs(v.sampling_logprobs[0] - np.log(dist[v.tokens[0]])) < 1e-5
        if len(v.tokens) == 2:  # the bonus token, from the second row's distribution
            kept2, dist2 = reference(target[1], *setting)
            assert set(v.supports[1].tolist()) == kept2
            assert abs(v.sampling_logprobs[1] - np.log(dist2[v.tokens[1]])) < 1e-5


def test_logprobs_on_support_and_its_gradient_are_the_masked_log_softmax():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(6, VOCAB, generator=gen, dtype=torch.float64).requires_grad_()
    support = [torch.randperm(VOCAB, generator=gen)[:n].sort().values.to(torch.int32)
               for n in (1, 3, 10, 50, VOCAB, 7)]
    tokens = torch.stack([s[len(s) // 2] for s in support]).long()
    got = logprobs_on_support(logits, support, temperature=0.7, tokens=tokens)
    mask = torch.zeros(6, VOCAB, dtype=torch.bool)
    for r, s in enumerate(support):
        mask[r, s.long()] = True

    def masked(x):  # the naive masked log_softmax, in x's dtype
        naive = torch.where(mask, x / 0.7, torch.tensor(float("-inf"), dtype=x.dtype))
        return naive.log_softmax(-1).gather(-1, tokens[:, None]).squeeze(-1)

    # got is float32: held to the float64 answer as torch's own float32 is
    want, own = masked(logits), masked(logits.float())
    assert_as_exact_as(got, want.detach(), own.detach(), "logprob on the support")
    grads = [torch.autograd.grad(x.sum(), logits)[0] for x in (got, want, own)]
    assert_as_exact_as(*grads, "its gradient")
    g_got = grads[0]
    assert torch.all(g_got[~mask] == 0)  # tokens outside the support get no gradient
    full = logprobs_on_support(logits, support)
    assert torch.isinf(full[~mask]).all() and full.shape == (6, VOCAB)


def test_logprobs_on_support_refuses_a_mismatch():
    logits = torch.zeros(2, 10)
    with pytest.raises(ValueError, match="support: 1 positions for 2"):
        logprobs_on_support(logits, [torch.tensor([1])])
    with pytest.raises(ValueError, match="temperature"):
        logprobs_on_support(logits, [torch.tensor([1])] * 2, temperature=0)
    with pytest.raises(ValueError, match="vocabulary 11, logits 10"):
        logprobs_on_support(logits, Support([None, None], 11))


L5 = torch.zeros(2, 5)
S5 = [torch.tensor([0, 1]), torch.tensor([2])]


@pytest.mark.parametrize("args, match", [
    ((L5.tolist(), S5), r"^logits must be a 2-D floating torch.Tensor \[T, V\], got list"),
    ((L5[0], S5[:1]), r"^logits must be a 2-D .*shape \(5,\)"),
    ((L5.long(), S5), r"^logits must be a 2-D floating .*torch.int64"),
    ((L5, S5, math.inf), r"^temperature must be a finite float"),
    ((L5, S5, "x"), r"^temperature must be a real number"),
    ((L5, S5, -1.0), r"^temperature must be > 0"),
    ((L5, 5), r"^support must be a Support or a list of T id tensors or lists, got int"),
    ((L5, [torch.tensor([-1]), torch.tensor([2])]), r"^support\[0\]: id -1 is outside the "
                                                    r"vocabulary \[0, 5\)"),
    ((L5, [torch.tensor([1]), torch.tensor([2, 7])]), r"^support\[1\]: id 7 is outside"),
    ((L5, [[0, 1], []]), r"^support\[1\] is empty"),  # its row had been all NaN
    ((L5, [torch.tensor([], dtype=torch.long), [2]]), r"^support\[0\] is empty"),
    ((L5, [[0, 1.5], [2]]), r"^support\[0\] must be a 1-D tensor or list of int token ids"),
    ((L5, [torch.tensor([[0, 1]]), [2]]), r"^support\[0\] must be a 1-D"),
    ((L5, [[True], [2]]), r"^support\[0\] must be a 1-D"),
    ((L5, Support([torch.tensor([9], dtype=torch.int32), None], 5)), r"^support\[0\]: id 9"),
    ((L5, S5, 1.0, torch.tensor([0])), r"^tokens: 1 ids for 2 logits rows"),
    ((L5, S5, 1.0, torch.tensor([0, 9])), r"^tokens\[1\]: id 9 is outside the vocabulary "
                                          r"\[0, 5\)"),
    ((L5, S5, 1.0, torch.tensor([0, 1])), r"^tokens\[1\]: id 1 is not in support\[1\]"),
    ((L5, S5, 1.0, torch.tensor([0.0, 2.0])), r"^tokens must be a 1-D tensor or list of int"),
])
def test_logprobs_on_support_refuses_bad_arguments_naming_them(args, match):
    """Each had given a silent wrong answer (an id of -1 read as V-1, an empty support a row of
    NaN, fewer tokens fewer values, an infinite temperature) or an IndexError/TypeError."""
    with pytest.raises(ValueError, match=match):
        logprobs_on_support(*args)


def test_logprobs_on_support_takes_support_rows_and_tokens_as_lists():
    logits = torch.randn(2, 5, generator=torch.Generator().manual_seed(0))
    want = logprobs_on_support(logits, S5, 0.5, torch.tensor([1, 2]))
    assert torch.equal(logprobs_on_support(logits, [[0, 1], [2]], 0.5, [1, 2]), want)
    assert torch.equal(logprobs_on_support(logits, (r.numpy() for r in S5), 0.5),
                       logprobs_on_support(logits, S5, 0.5))


def test_the_engine_returns_both_and_they_agree_with_the_trainers_renormalisation():
    """A tiny model's samples: sampling logprobs equal to the logprobs where nothing
    truncates, and where top-p does, equal to a transformers forward renormalised over the
    returned support (what a trainer computes with logprobs_on_support)."""
    model = tiny_model("llama")
    engine = Engine(model, EngineConfig(kv_cache_tokens=1024, max_model_len=64))
    prompts = [[1, 2, 3, 4], [5, 6, 7]]
    full, cut = (engine.generate(prompts, SamplingParams(
        n=3, temperature=0.9, top_p=p, max_tokens=10, logprobs=True, seed=4,
        return_support=True)) for p in (1.0, 0.8))
    # Filters set that keep every token are no truncation either: top_k at or above the
    # vocabulary (128), a top_p that is 1 in the sampler's float32, a min_p below every
    # token's share of the top one's (each had given a renormalised logprob an ulp off and
    # the whole vocabulary as an explicit support).
    kept_all = [engine.generate(prompts, SamplingParams(
        n=3, temperature=0.9, max_tokens=10, logprobs=True, seed=4, return_support=True, **kw))
        for kw in ({"top_k": 128}, {"top_k": 1000}, {"top_p": 1 - 1e-9}, {"min_p": 1e-30})]
    for outs in (full, *kept_all):
        for out in outs:
            for s in out.samples:
                assert s.sampling_logprobs == s.logprobs
                assert all(s.support.is_full(j) for j in range(len(s.token_ids)))
    gaps, worst_truncated = [], 0.0
    for prompt, out in zip(prompts, cut):
        for s in out.samples:
            assert len(s.support) == len(s.token_ids) == len(s.sampling_logprobs)
            seq = torch.tensor([prompt + s.token_ids])
            with torch.no_grad():
                logits = model(seq).logits[0, len(prompt) - 1:-1]
            mine = logprobs_on_support(logits, s.support, 0.9, torch.tensor(s.token_ids))
            gaps.append((mine - torch.tensor(s.sampling_logprobs)).abs().max().item())
            worst_truncated = max(worst_truncated,
                                  max(a - b for a, b in zip(s.sampling_logprobs, s.logprobs)))
    assert max(gaps) < 1e-4  # the engine's logits against transformers' (tests/models parity)
    assert worst_truncated > 0.01  # top-p cut something: the two differ somewhere
    plain = engine.generate(prompts[:1], SamplingParams(max_tokens=3, logprobs=False))[0]
    assert plain.samples[0].sampling_logprobs is None and plain.samples[0].support is None


def test_speculation_changes_no_sampling_logprob():
    """n-gram speculation verifies drafts: the same tokens, logprobs, sampling logprobs and
    supports as without it (coupled acceptance: every emitted token is the target's sample)."""
    from rollout.spec import SpeculativeConfig

    model = tiny_model("llama")
    prompts = [[1, 2, 3, 1, 2, 3, 1, 2, 3], [4, 5, 4, 5, 4, 5]]
    params = SamplingParams(n=2, temperature=0.8, top_k=8, top_p=0.9, max_tokens=12,
                            logprobs=True, seed=3, return_support=True)
    outs = []
    for spec in (None, SpeculativeConfig(method="ngram", num_speculative_tokens=3)):
        engine = Engine(model, EngineConfig(kv_cache_tokens=1024, max_model_len=64,
                                            speculative=spec))
        outs.append(engine.generate(prompts, params))
    assert engine.stats.spec_verifications > 0
    for a, b in itertools.chain.from_iterable(zip(x.samples, y.samples)
                                              for x, y in zip(*outs)):
        assert a.token_ids == b.token_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
        assert a.sampling_logprobs == pytest.approx(b.sampling_logprobs, abs=1e-5)
        assert [x.tolist() for x in a.support] == [x.tolist() for x in b.support]
