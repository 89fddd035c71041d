"""Drafting from history (SpeculativeConfig(method="suffix")): the history's matches against a
brute-force search under random insertions and evictions; drafts only continue what occurred;
the budget holds; outputs unchanged (greedy, seeded under coupled acceptance, distribution
under rejection); kept across sleep, cleared on request; per-source stats."""

import tracemalloc
from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from helpers import pin_step_cost
from models import tiny_model
from scipy.stats import chisquare

from rollout import Engine, EngineConfig, SamplingParams, SpeculativeConfig
from rollout.spec.config import MAX_HISTORY_MATCH
from rollout.spec.history import MAX_CANDIDATES, DraftHistory

MIN, MAX = 2, 5


def brute_matches(entries, context, prompt, min_match=MIN, max_match=MAX):
    """(length, positions) as DraftHistory.matches defines them, by exhaustive search: among
    the newest MAX_CANDIDATES places where the context's last min_match tokens occur followed
    by something, those matching the most of the context's tail (at most max_match)."""
    def search(pool):
        gram = context[len(context) - min_match:]
        places = [(eid, end) for eid, (_, tokens) in pool.items()
                  for end in range(min_match, len(tokens))
                  if len(context) >= min_match and tokens[end - min_match:end] == gram]
        best, found = 0, set()
        for eid, end in places[-MAX_CANDIDATES:]:
            tokens = pool[eid][1]
            n = 0
            while (n < min(max_match, end, len(context))
                   and tokens[end - n - 1] == context[len(context) - n - 1]):
                n += 1
            if n > best:
                best, found = n, {(eid, end)}
            elif n == best:
                found.add((eid, end))
        return best, found
    own = {e: v for e, v in entries.items() if v[0] == tuple(prompt)}
    best, found = search(own)
    return (best, found) if found else search(entries)


def named(history, positions, ordered=False):
    """(entry id, offset in the entry) of each of DraftHistory's positions (buffer offsets)."""
    starts = sorted((start, eid) for eid, (start, _) in history.entries.items())
    places = [next((eid, p - start) for start, eid in reversed(starts) if start <= p)
              for p in positions.tolist()]
    return places if ordered else set(places)


def brute_continuation(entries, places, k, min_share):
    """DraftHistory.continuation by its definition over (entry id, offset) places, newest
    first: the most common next token (ties: the first place's), while enough agree."""
    draft, alive = [], [(entries[eid][1], end) for eid, end in places]
    for j in range(k):
        counts = Counter(t[end + j] for t, end in alive if end + j < len(t))
        if not counts:
            break
        token, count = counts.most_common(1)[0]  # first counted among the most common
        if count < min_share * len(places):
            break
        draft.append(token)
        alive = [(t, end) for t, end in alive if end + j < len(t) and t[end + j] == token]
    return draft


tokens_st = st.lists(st.integers(0, 3), min_size=0, max_size=12)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([(1,), (2, 2), (3,)]), tokens_st), max_size=25),
       st.lists(st.integers(0, 3), min_size=1, max_size=8), st.sampled_from([(1,), (2, 2)]),
       st.integers(10, 80))
def test_matches_equal_brute_force_under_insertions_and_evictions(adds, context, prompt,
                                                                 budget):
    history = DraftHistory(budget, MIN, MAX)
    alive = {}  # eid -> (prompt, stored tokens), oldest first, as the budget evicts
    for p, completion in adds:
        eid = history.add(list(p), completion)
        stored = list(p)[-MAX:] + completion
        if eid is None:
            assert not completion or len(stored) > budget
            continue
        alive[eid] = (p, stored)
        while sum(len(t) for _, t in alive.values()) > budget:
            del alive[next(iter(alive))]
        assert history.tokens == sum(len(t) for _, t in alive.values()) <= budget
        assert set(history.entries) == set(alive)
    length, positions = history.matches(context, list(prompt))
    want_len, want = brute_matches(alive, context, prompt)
    assert (length, named(history, positions)) == (want_len,
                                                                                   want)
    # A draft only ever continues what followed the match somewhere.
    draft = history.continuation(positions, 4, 0.3)
    if draft:
        tail = context[-length:] + draft
        assert any(tail == t[i:i + len(tail)] for _, t in alive.values()
                   for i in range(len(t)))


def test_matches_equal_brute_force_past_the_candidate_cap_and_compaction():
    """Thousands of entries under a budget that evicts most of them (the buffer and indexes
    then compacted, offsets moved), and a budget large enough that a frequent gram occurs in
    more than MAX_CANDIDATES places: matches, drafts and entry names as the brute force."""
    rng = np.random.default_rng(0)
    for budget, count, vocab in [(120, 3000, 4), (1 << 16, 600, 3)]:
        history = DraftHistory(budget, 1, 8)
        alive = {}
        for i in range(count):
            prompt = [int(rng.integers(2))]
            completion = rng.integers(0, vocab, int(rng.integers(1, 12))).tolist()
            eid = history.add(prompt, completion)
            alive[eid] = (tuple(prompt), prompt[-8:] + completion)
            while sum(len(t) for _, t in alive.values()) > budget:
                del alive[next(iter(alive))]
            if i % 97 == 0 or i == count - 1:
                assert set(history.entries) == set(alive)
                for _ in range(5):
                    context = rng.integers(0, vocab, int(rng.integers(1, 12))).tolist()
                    length, positions = history.matches(context, prompt)
                    want_len, want = brute_matches(alive, context, prompt, 1, 8)
                    assert length == want_len
                    assert named(history, positions) == want
                    for share in (0.1, 0.5):
                        assert history.continuation(positions, 4, share) == \
                            brute_continuation(alive, named(history, positions, ordered=True), 4,
                                               share)
        assert history.evicted == count - len(alive)
    assert len(want) > 0 and max(len(t) for _, t in alive.values()) > 1


PROMPTS = [[1, 2, 3, 4, 5, 6], [9, 8, 7], list(range(20, 40))]
# The step cost adaptive drafting weighs against, pinned (the engine's own clock would make the
# counts depend on the machine's load): SmolLM2's fp32 line on a 2-core Zen 4, 24.9 ms a step
# + 1.34 ms a position (docs/benchmarks.md, spec_history).
SMOLLM2_CPU = (0.0249, 0.00134)


@pytest.fixture(scope="module")
def target():
    return tiny_model("qwen2")


def engine(model, spec=None, **kw):
    return Engine(model, EngineConfig(**(dict(kv_cache_tokens=4096, max_model_len=160) | kw),
                                      speculative=spec))


def suffix(**kw):
    return SpeculativeConfig("suffix", num_speculative_tokens=5, **kw)


def tokens(outs):
    return [s.token_ids for o in outs for s in o.samples]


@pytest.mark.parametrize("adaptive", [False, True], ids=["fixed", "adaptive"])
@pytest.mark.parametrize("temperature", [0, 0.8])
def test_epochs_draft_from_history_and_change_no_output(target, temperature, adaptive):
    """Three epochs over the same prompts: every epoch's samples equal speculation off's; from
    the second on, history drafts and is accepted (the same seeds sample the same answers)."""
    params = SamplingParams(n=3, max_tokens=30, temperature=temperature, seed=1, ignore_eos=True)
    want = tokens(engine(target).generate(PROMPTS, params))
    spec = engine(target, suffix(adaptive=adaptive))
    if adaptive:
        pin_step_cost(spec, *SMOLLM2_CPU)
    for epoch in range(3):
        assert tokens(spec.generate(PROMPTS, params)) == want
        history = spec.stats.spec_sources.get("history", [0, 0])
        if epoch == 0:
            assert history == [0, 0]
    proposed, accepted = spec.stats.spec_sources["history"]
    # Greedy: the same answers (all accepted); seeded: siblings differ, and a match shared by
    # them drafts the majority continuation, not necessarily this sample's.
    assert proposed > 0 and accepted / proposed > 0.5
    assert spec.stats.tokens_per_verification > 3
    spec.check_invariants()


def test_history_survives_sleep_and_is_cleared_on_request(target):
    params = SamplingParams(n=2, max_tokens=20, temperature=0.8, seed=2, ignore_eos=True)
    spec = engine(target, suffix())
    want = tokens(spec.generate(PROMPTS, params))
    spec.generate([[5]], SamplingParams(max_tokens=2))  # flushes the first call's samples
    held = spec.stats.draft_history_tokens
    assert held > 0
    for level in (1, 2):
        spec.sleep(level)
        spec.wake_up()
        if level == 2:
            spec.update_weights(target)
        assert spec.stats.draft_history_tokens == held
    before = spec.stats.spec_sources.get("history", [0, 0])[1]
    assert tokens(spec.generate(PROMPTS, params)) == want
    assert spec.stats.spec_sources["history"][1] > before
    spec.clear_draft_history()
    assert spec.stats.draft_history_tokens == 0


def test_budget_bounds_the_history_and_counts_evictions(target):
    spec = engine(target, suffix(history_tokens=100))
    for seed in range(4):
        spec.generate(PROMPTS, SamplingParams(n=2, max_tokens=20, seed=seed, ignore_eos=True))
    st_ = spec.stats
    assert 0 < st_.draft_history_tokens <= 100 and st_.draft_history_evicted > 0
    # A count over the engine's life, as its other stats (a step's delta of it must not go
    # negative): clearing the history had set it back to 0.
    spec.clear_draft_history()
    assert spec.stats.draft_history_evicted == st_.draft_history_evicted


def test_rejection_acceptance_keeps_the_distribution():
    """Vocabulary 8, one prompt: an epoch fills the history, the next draws 1500 seeded samples
    under rejection acceptance; the (first, second) token pairs follow the model's own
    probabilities (chi-square), with history drafts proposed and accepted."""
    model = tiny_model("qwen2", vocab_size=8)
    spec = engine(model, SpeculativeConfig("suffix", num_speculative_tokens=3,
                                           acceptance="rejection", max_batch_size=4096),
                  max_num_seqs=512, kv_cache_tokens=8192)
    prompt = [1, 2, 3, 1, 2]
    spec.generate([prompt], SamplingParams(n=100, max_tokens=2, seed=0, ignore_eos=True))
    outs = spec.generate([prompt], SamplingParams(n=1500, max_tokens=2, seed=1,
                                                  ignore_eos=True))
    assert spec.stats.spec_sources["history"][1] > 0
    pairs = np.bincount([8 * s.token_ids[0] + s.token_ids[1] for s in outs[0].samples],
                        minlength=64)
    with torch.no_grad():
        first = model(torch.tensor([prompt])).logits[0, -1].double().softmax(-1)
        second = torch.stack([model(torch.tensor([prompt + [t]])).logits[0, -1].double()
                              .softmax(-1) for t in range(8)])
    expected = (first[:, None] * second).flatten().numpy() * 1500
    keep = expected > 5  # chi-square needs populated cells; the rest pooled
    observed = np.append(pairs[keep], pairs[~keep].sum())
    expected = np.append(expected[keep], expected[~keep].sum())
    assert chisquare(observed, expected).pvalue > 1e-3


def test_bad_history_settings_are_refused():
    with pytest.raises(ValueError, match="history_min_share must be in"):
        SpeculativeConfig("suffix", history_min_share=0)
    with pytest.raises(ValueError, match="history_tokens must be"):
        SpeculativeConfig("suffix", history_tokens=0)
    with pytest.raises(ValueError, match="history_max_match must be"):
        SpeculativeConfig("suffix", ngram_min=3, ngram_max=4, history_max_match=2)


def test_history_max_match_is_bounded_and_reserves_nothing_up_front():
    """A lookup extends its match a token at a time, so history_max_match is bounded: past
    MAX_HISTORY_MATCH it is refused naming the field and the limit (2**40 once failed with a
    MemoryError, 16 TiB of buffer allocated up front). At the limit an empty history holds
    little more than its leading gaps, and a match of the full length is found."""
    for bad in (MAX_HISTORY_MATCH + 1, 10**7, 2**40):
        with pytest.raises(ValueError, match=rf"speculative.history_max_match must be in "
                                             rf"\[1, {MAX_HISTORY_MATCH}\]"):
            SpeculativeConfig("suffix", history_max_match=bad)
    config = SpeculativeConfig("suffix", history_max_match=MAX_HISTORY_MATCH)
    history = DraftHistory(config.history_tokens, config.ngram_min, config.history_max_match)
    assert history._flat.nbytes <= 4 * 2 * MAX_HISTORY_MATCH  # (10**7 took 153 MiB)
    rng = np.random.default_rng(0)
    prompt, completion = [1, 2, 3], rng.integers(0, 50, 3 * MAX_HISTORY_MATCH).tolist()
    history.add(prompt, completion)
    history.check()
    context = prompt + completion[:2 * MAX_HISTORY_MATCH]
    length, positions = history.matches(context, prompt)
    assert length == MAX_HISTORY_MATCH and len(positions) == 1
    assert history.continuation(positions, 4, 1.0) == completion[2 * MAX_HISTORY_MATCH:][:4]


def test_the_history_holds_at_most_the_documented_bytes_a_token():
    """docs/speculation.md states the history's host bytes a held token; uniformly random
    tokens in a small history are the worst case (every token a gram of its own under its
    prompt, the global index's grams over few tokens), measured as the docs say, past the
    budget so that evictions and compactions run."""
    budget = 10_000
    rng = np.random.default_rng(0)
    prompts = rng.integers(0, 49152, (16, 200)).tolist()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        history = DraftHistory(budget, 1, 32)
        worst = 0.0
        for i in range(3 * budget // 150):
            completion = rng.integers(0, 49152, int(rng.integers(20, 280))).tolist()
            history.add(prompts[i % 16], completion)
            worst = max(worst, (tracemalloc.get_traced_memory()[0] - base) / history.tokens)
    finally:
        tracemalloc.stop()
    assert history.evicted > 0
    assert worst <= 1000  # ~650 measured (Python 3.11): room for allocator details, not a 2x


def test_carried_groups_keep_drafting_from_history_across_an_update(target):
    """Partial rollouts: groups carried across update_weights (the same weights) resume
    drafting from history, and every token equals speculation off's."""
    params = [SamplingParams(n=2, max_tokens=m, temperature=0.8, seed=3, ignore_eos=True)
              for m in (8, 40, 40)]  # the short group completes first, the others are carried

    def run(spec):
        eng = engine(target, spec)
        eng.generate(PROMPTS, params)  # the previous epoch
        first = eng.rollout(PROMPTS, params, groups=1)
        assert len(eng.carried) == 2
        eng.update_weights(target)
        accepted = eng.stats.spec_sources.get("history", [0, 0])[1]
        rest = eng.rollout()
        return tokens(first + rest), eng.stats.spec_sources.get("history", [0, 0])[1] - accepted

    got, after_update = run(suffix())
    assert got == run(None)[0]
    assert after_update > 0


def test_adaptive_drafts_what_pays():
    """A random model: its own-token n-grams are rarely right. Adaptive drafting proposes far
    fewer tokens for the same outputs; a batch above max_batch_size is counted as skipped."""
    model = tiny_model("qwen2", seed=4)
    params = SamplingParams(n=4, max_tokens=40, temperature=1.0, seed=2, ignore_eos=True)
    fixed, adaptive = (engine(model, SpeculativeConfig("ngram", num_speculative_tokens=5,
                                                       adaptive=a)) for a in (False, True))
    pin_step_cost(adaptive, *SMOLLM2_CPU)
    assert tokens(fixed.generate(PROMPTS, params)) == tokens(adaptive.generate(PROMPTS, params))
    f, a = fixed.stats, adaptive.stats
    assert a.spec_steps > 0 and a.spec_skipped_steps == 0
    assert a.spec_proposed < 0.6 * f.spec_proposed
    assert a.spec_proposed / a.spec_verifications < f.spec_proposed / f.spec_verifications
    small = engine(model, SpeculativeConfig("ngram", max_batch_size=4))
    small.generate(PROMPTS, params)  # 12 decoding samples > 4 until some finish
    assert small.stats.spec_skipped_steps > 0
