"""Speculative decoding: greedy and seeded outputs unchanged, exact acceptance statistics,
rollback keeps the invariants, preemption and stops inside accepted drafts."""

import numpy as np
import pytest
import torch
from helpers import run_checked, samples
from models import tiny_model
from scipy.stats import chisquare

from rollout import Engine, EngineConfig, SamplingParams
from rollout.sample.sampler import SamplingBatch
from rollout.spec import SpeculativeConfig
from rollout.spec.verify import verify

# Repetitive prompts give the n-gram drafter something to find.
PROMPTS = [[1, 2, 3, 4, 5] * 3, list(range(10, 30)) * 2, [7, 8, 9], [4, 4, 4, 4, 4, 4]]


@pytest.fixture(scope="module")
def target():
    return tiny_model("qwen2")


def engine(model, spec=None, **kw):
    cfg = dict(kv_cache_tokens=2048, max_model_len=160)
    cfg.update(kw)
    return Engine(model, EngineConfig(speculative=spec, **cfg))


def baseline(model, params, **kw):
    return samples(run_checked(engine(model, **kw), PROMPTS, params))


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5])
def test_ngram_greedy_equals_plain_greedy(target, k):
    params = SamplingParams(n=2, temperature=0, max_tokens=30)
    spec = engine(target, SpeculativeConfig("ngram", num_speculative_tokens=k))
    assert samples(run_checked(spec, PROMPTS, params)) == baseline(target, params)
    assert spec.stats.spec_proposed > 0


@pytest.mark.parametrize("k", [1, 3, 5])
def test_draft_model_greedy_equals_plain_greedy(target, k):
    params = SamplingParams(n=2, temperature=0, max_tokens=30)
    draft = tiny_model("qwen2", seed=3, num_hidden_layers=1)
    spec = engine(target, SpeculativeConfig("draft", num_speculative_tokens=k, draft_model=draft))
    assert samples(run_checked(spec, PROMPTS, params)) == baseline(target, params)
    assert spec.stats.spec_proposed > 0


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_drafts_count_against_the_step_token_budget(target, method, monkeypatch):
    """max_num_batched_tokens is the tokens a step computes: the drafts' verify positions fit
    in what the scheduled tokens leave of it (cut, or none), and a draft model's forwards,
    its catch-up of a 40-token prompt included, in the budget too; the outputs unchanged."""
    params = SamplingParams(n=2, temperature=0, max_tokens=30)
    draft = tiny_model("qwen2", seed=3, num_hidden_layers=1) if method == "draft" else None
    spec = engine(target, SpeculativeConfig(method, num_speculative_tokens=6, draft_model=draft),
                  max_num_batched_tokens=11)
    runners = [spec.runner] + ([spec.speculator.drafter.runner] if draft else [])
    sizes = [[] for _ in runners]
    for runner, seen in zip(runners, sizes):
        monkeypatch.setattr(runner, "prepare", lambda batch, prepare=runner.prepare, seen=seen:
                            (seen.append(batch.num_tokens), prepare(batch))[1])
    assert samples(run_checked(spec, PROMPTS, params)) == baseline(target, params)
    assert spec.stats.spec_proposed > 0 and max(sizes[0]) == 11
    assert all(max(seen) <= 11 for seen in sizes)


def test_draft_identical_to_target_accepts_everything(target):
    params = SamplingParams(n=3, temperature=0.9, max_tokens=25, seed=5)
    spec = engine(target, SpeculativeConfig("draft", num_speculative_tokens=4, draft_model=target))
    outs = run_checked(spec, PROMPTS, params)
    st = spec.stats
    assert st.spec_proposed > 0 and st.spec_accepted == st.spec_proposed
    assert st.tokens_per_verification > 3
    assert samples(outs) == baseline(target, params)


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_coupled_sampling_changes_no_output(target, method):
    params = SamplingParams(n=3, temperature=1.0, top_p=0.95, max_tokens=30, seed=11)
    draft = tiny_model("qwen2", seed=3) if method == "draft" else None
    spec = engine(target, SpeculativeConfig(method, num_speculative_tokens=3, draft_model=draft),
                  max_num_seqs=5)
    assert samples(run_checked(spec, PROMPTS, params)) == baseline(target, params)


def test_rejection_rule_is_reproducible(target):
    draft = tiny_model("qwen2", seed=3)
    cfg = SpeculativeConfig("draft", num_speculative_tokens=3, draft_model=draft,
                            acceptance="rejection")
    params = SamplingParams(n=2, temperature=1.0, max_tokens=20, seed=2)
    a = samples(run_checked(engine(target, cfg), PROMPTS, params))
    b = samples(run_checked(engine(target, cfg), PROMPTS, params))
    assert a == b


def test_preemption_while_speculating(target):
    params = SamplingParams(n=2, temperature=0.8, max_tokens=40, seed=9)
    spec = engine(target, SpeculativeConfig("ngram", num_speculative_tokens=4),
                  kv_cache_tokens=200, max_model_len=100)
    outs = run_checked(spec, PROMPTS, params)
    assert spec.stats.preemptions > 0 and spec.stats.spec_proposed > 0
    assert samples(outs) == baseline(target, params, max_model_len=100)


def test_stop_inside_accepted_drafts(target):
    params = SamplingParams(temperature=0, max_tokens=40)
    plain = baseline(target, params)
    stop = plain[0][0][12]  # a token that appears mid-output: later drafts must be dropped
    params = SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[stop])
    spec = engine(target, SpeculativeConfig("ngram", num_speculative_tokens=5))
    assert samples(run_checked(spec, PROMPTS, params)) == baseline(target, params)


def test_turns_off_for_large_batches(target):
    params = SamplingParams(n=4, temperature=0, max_tokens=10)
    spec = engine(target, SpeculativeConfig("ngram", num_speculative_tokens=3, max_batch_size=2))
    run_checked(spec, PROMPTS, params)
    assert spec.stats.spec_verifications == 0


# --- the acceptance rules, statistically -----------------------------------------------------
@pytest.mark.parametrize("rule, proposal", [("coupled", "ngram"), ("rejection", "draft")])
def test_first_emitted_token_follows_the_target(rule, proposal):
    """One draft per request; the first emitted token must be distributed as p, whatever q."""
    vocab, n = 8, 20000
    gen = torch.Generator().manual_seed(0)
    p_logits = torch.randn(vocab, generator=gen) * 1.5
    q = torch.randn(vocab, generator=gen).mul(1.5).softmax(-1)
    if proposal == "ngram":
        drafts = [[3]] * n
        probs = [None] * n
    else:
        tokens = torch.multinomial(q, n, replacement=True, generator=gen).tolist()
        drafts = [[t] for t in tokens]
        probs = [q[None, :]] * n
    # Two rows per request: the draft's position and the bonus position.
    logits = p_logits.repeat(2 * n, 1)
    rows = SamplingBatch.build([1.0] * 2 * n, [0] * 2 * n, [1.0] * 2 * n, [0.0] * 2 * n,
                               [s for s in range(n) for _ in range(2)],
                               [7, 8] * n, "cpu")
    verdicts = verify(logits, rows, drafts, probs, rule)
    first = np.bincount([v.tokens[0] for v in verdicts], minlength=vocab)
    expected = p_logits.softmax(-1).double().numpy() * n
    assert chisquare(first, expected).pvalue > 1e-3
    accepted = np.mean([v.accepted for v in verdicts])
    if proposal == "ngram":  # accept probability is p(d)
        assert abs(accepted - float(p_logits.softmax(-1)[3])) < 0.02
    else:  # optimal rule: 1 - TV(p, q)
        p = p_logits.softmax(-1)
        assert abs(accepted - float(torch.minimum(p, q).sum())) < 0.02
