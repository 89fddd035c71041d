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
from rollout.spec.speculator import RATE_ENGINE
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


def test_a_group_drafts_whole_from_its_second_round(target):
    """The first sample of a group computes its prompt in the draft; every sibling joins the
    round after, not one a round (n = 8 samples had drafted from rounds 1, 2, ..., 8)."""
    draft = tiny_model("qwen2", seed=3, num_hidden_layers=1)
    spec = engine(target, SpeculativeConfig("draft", num_speculative_tokens=2, draft_model=draft))
    spec.add_request(PROMPTS[1], SamplingParams(n=8, temperature=1.0, max_tokens=40, seed=0))
    drafter = spec.speculator.drafter
    joined = []
    for _ in range(4):
        spec.step()
        joined.append(len(drafter.shadows))
    assert joined[:3] == [0, 1, 8], joined  # (step 1 prefills the target: nothing drafts)


def test_a_draft_model_of_a_shorter_context_drafts_past_it(target):
    """A draft whose context (max_position_embeddings) is shorter than the target's
    max_model_len is served (TinyLlama's 2048 for a 4096 target): only the target's context
    bounds max_model_len; past its own, a draft drafts worse, and the outputs stay the
    target's. (It had been refused as if the target's limit were passed.)"""
    params = SamplingParams(n=2, temperature=0, max_tokens=30)
    draft = tiny_model("qwen2", seed=3, num_hidden_layers=1, max_position_embeddings=32)
    spec = engine(target, SpeculativeConfig("draft", num_speculative_tokens=3, draft_model=draft))
    assert samples(run_checked(spec, PROMPTS, params)) == baseline(target, params)
    assert spec.stats.spec_proposed > 0
    with pytest.raises(ValueError, match="max_model_len: 160 is more than the model's context"):
        engine(draft)


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


def test_a_draft_model_drafts_no_more_than_the_step_verifies(target):
    """A draft model computes every token it proposes (a forward each): it is asked for no
    more than the step's token budget leaves for verification (16 decodes in a budget of 20,
    drafts of up to 4: it drafted 397 tokens for 165 verified). Counted naively: the tokens
    its proposals held against the draft tokens verified; outputs as without speculation."""
    params = SamplingParams(n=4, temperature=0, max_tokens=30, ignore_eos=True)
    spec = engine(target, SpeculativeConfig("draft", num_speculative_tokens=4,
                                            draft_model=target), max_num_batched_tokens=20)
    drafter, drafted = spec.speculator.drafter, []

    def counted(wanted, siblings, propose=drafter.propose_batch):
        proposals = propose(wanted, siblings)
        drafted.extend(len(tokens) for tokens, _ in proposals)
        return proposals
    drafter.propose_batch = counted
    assert samples(run_checked(spec, PROMPTS, params)) == baseline(
        target, params, max_num_batched_tokens=20)
    assert spec.stats.spec_proposed > 0
    assert sum(drafted) == spec.stats.spec_proposed


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


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_rejection_of_deterministic_drafts_changes_no_output(target, method):
    """n-gram and history proposals are deterministic (q one-hot), for which the textbook
    min(1, p/q) rule is coupled acceptance's: under "rejection" they are verified with the
    target's own noise, so the samples are speculation off's whatever the drafts, which
    depend on scheduling: on a second call (the prefix cache, the history) and beside an
    unrelated request (siblings' progress, the step's token budget) they once differed."""
    params = SamplingParams(n=4, temperature=1.0, max_tokens=40, seed=2, ignore_eos=True)
    want = baseline(target, params, max_num_batched_tokens=32)
    spec = engine(target, SpeculativeConfig(method, num_speculative_tokens=5,
                                            acceptance="rejection"), max_num_batched_tokens=32)
    for _ in range(2):
        assert samples(run_checked(spec, PROMPTS, params)) == want
    other = SamplingParams(temperature=0, max_tokens=30)
    mixed = run_checked(spec, PROMPTS + [list(range(40, 120))], [params] * len(PROMPTS) + [other])
    assert samples(mixed[:len(PROMPTS)]) == want
    assert spec.stats.spec_accepted > 0


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


def test_stats_count_what_the_samples_kept(target):
    """A stop inside accepted drafts: the verifier accepted the drafts past it, the sample never
    got them. spec_accepted, spec_emitted, spec_sources and the running acceptance that
    adaptive drafting uses (Speculator.rates) count what each verification committed: as
    counted naively from the tokens each drafting sample gained in its step (they once counted
    the drafts past the stop)."""
    prompt = PROMPTS[0]
    spec = engine(target, SpeculativeConfig("suffix", num_speculative_tokens=5))
    first = spec.generate([prompt], SamplingParams(temperature=0, max_tokens=30,
                                                   ignore_eos=True))[0].samples[0].token_ids
    stop = next(t for i, t in enumerate(first) if i >= 3 and t not in first[:i])
    spec.generate([[9]], SamplingParams(max_tokens=1))  # the first answer into the history
    drafted = []  # (sequence, its draft, its tokens before the step, the draft's source)
    propose = spec.speculator.propose

    def watched(batch):
        extended = propose(batch)
        drafted.extend((it.seq, list(it.draft), len(it.seq.token_ids),
                        spec.speculator.sources[it.seq.seq_id]) for it in batch.items if it.draft)
        return extended
    spec.speculator.propose = watched
    st = spec.stats
    before = (st.spec_proposed, st.spec_accepted, st.spec_emitted, st.spec_verifications)
    sources = {name: list(counts) for name, counts in st.spec_sources.items()}
    rates = dict(spec.speculator.rates)
    proposed = accepted = emitted = verifications = 0
    cut_in_drafts = False
    spec.add_request(prompt, SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop]))
    spec.add_request(PROMPTS[1], SamplingParams(temperature=0, max_tokens=30))
    while spec.has_unfinished:
        spec.step()
        spec.check_invariants()
        for seq, draft, start, source in drafted:
            got = seq.token_ids[start:]
            kept = next((i for i, (a, b) in enumerate(zip(got, draft)) if a != b),
                        min(len(got), len(draft)))
            cut_in_drafts |= got[-1] == stop and got == draft[:len(got)]
            proposed, accepted, emitted = (proposed + len(draft), accepted + kept,
                                           emitted + len(got))
            verifications += 1
            counts = sources.setdefault(source, [0, 0])
            counts[0], counts[1] = counts[0] + len(draft), counts[1] + kept
            rate = rates.get(source, 0.5)
            rates[source] = rate + RATE_ENGINE * (kept / len(draft) - rate)
        drafted.clear()
    assert cut_in_drafts and verifications > 1
    assert (st.spec_proposed - before[0], st.spec_accepted - before[1],
            st.spec_emitted - before[2], st.spec_verifications - before[3]) == \
        (proposed, accepted, emitted, verifications)
    assert st.spec_sources == sources
    assert spec.speculator.rates == pytest.approx(rates)


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
