"""The n-gram drafter against a brute-force search: a step's proposals (each source's tokens
converted once for the whole step) are each sample's own, found token by token."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from rollout.requests.sequence import Sequence
from rollout.sample.params import SamplingParams
from rollout.spec.ngram import NgramDrafter, find_continuation


def naive_continuation(source: list[int], pattern: list[int], k: int) -> list[int]:
    """The newest i with source[i:i+n] == pattern and a token after it; then k tokens copied
    from i + n on, past the end of source from the proposal itself."""
    n = len(pattern)
    for i in range(len(source) - n - 1, -1, -1):
        if source[i:i + n] == pattern:
            proposal: list[int] = []
            for j in range(i + n, i + n + k):
                proposal.append(source[j] if j < len(source) else proposal[j - len(source)])
            return proposal
    return []


def naive_draft(seq: Sequence, group: list[Sequence], k: int, ngram_min: int, ngram_max: int):
    tokens = seq.token_ids
    sources = [tokens] + [s.token_ids for s in group if s is not seq]
    for n in range(min(ngram_max, len(tokens) - 1), ngram_min - 1, -1):
        for source in sources:
            found = naive_continuation(source, tokens[-n:], k)
            if found:
                return found
    return []


tokens = st.lists(st.integers(0, 5) | st.sampled_from([-1, 2**31 - 1, 256, 65536]),
                  min_size=1, max_size=30)


@given(st.lists(st.tuples(tokens, st.lists(tokens, min_size=1, max_size=4)), min_size=1,
                max_size=4),
       st.integers(1, 6), st.integers(1, 3), st.integers(0, 12))
@settings(max_examples=300, deadline=None)
def test_a_step_s_drafts_are_the_brute_force_search_s(groups, k, ngram_min, extra):
    """Small vocabularies (matches everywhere), ids whose int32 bytes repeat inside other
    ids' (256, 65536: a byte-aligned hit that straddles two tokens must not count), and n
    ranges up to 13 wide (the longest n is bisected)."""
    ngram_max = ngram_min + extra
    seqs, by_group = [], {}
    for g, (prompt, outputs) in enumerate(groups):
        for i, output in enumerate(outputs):
            seq = Sequence(len(seqs), str(g), i, prompt, SamplingParams(), 0, frozenset())
            seq.token_ids.extend(output)
            seqs.append(seq)
            by_group.setdefault(str(g), []).append(seq)
    wanted = [(seq, k) for seq in seqs]
    drafter = NgramDrafter(ngram_min, ngram_max)
    got = drafter.propose_batch(wanted, lambda s: by_group[s.group])
    want = [(naive_draft(seq, by_group[seq.group], k, ngram_min, ngram_max), None)
            for seq in seqs]
    assert got == want


@given(tokens, st.lists(st.integers(0, 5), min_size=1, max_size=4), st.integers(1, 6))
@settings(max_examples=300, deadline=None)
def test_find_continuation_is_the_brute_force_search(source, pattern, k):
    assert find_continuation(source, pattern, k) == naive_continuation(source, pattern, k)


def test_scans_grow_with_the_log_of_the_n_range(monkeypatch):
    """Whether some source holds the sequence's last n tokens (with a token after) can only
    fail from some n on: a longer n's occurrence holds every shorter one's. So the longest n is
    found in O(log(ngram_max - ngram_min)) scans of the sources, not one scan per n (a sample
    matching nowhere scanned its own tokens and each sibling's 1,024 times a step at
    ngram_max=1024: host time quadratic in its length). Counted: the scans of one source for
    a sample matching nowhere, one whose longest match is 700 tokens, one matching at every n;
    the drafts those sequences continue with (the brute force's on short ones:
    test_a_step_s_drafts_are_the_brute_force_search_s)."""
    import rollout.spec.ngram as ngram

    scans = []
    monkeypatch.setattr(ngram, "find_continuation", lambda source, pattern, k, hay=None: (
        scans.append(len(pattern)), find_continuation(source, pattern, k, hay))[1])
    lo, hi = 1, 1024
    cases = [(list(range(2000)), []),  # no token repeats
             # the last 700 tokens occur once before, followed by 0; the last 701 do not
             ([7] + list(range(700)) * 2, [0, 1, 2, 3]),
             ([3] * 2000, [3] * 4)]
    for tokens, want in cases:
        seq = Sequence(0, "g", 0, tokens, SamplingParams(), 0, frozenset())
        scans.clear()
        assert NgramDrafter(lo, hi).propose_batch([(seq, 4)], lambda s: [s]) == [(want, None)]
        assert len(scans) <= 2 + (hi - lo).bit_length(), len(scans)


def test_the_default_lengths_are_tried_longest_first_one_by_one(monkeypatch):
    """Over the default 1-4, lengths go down one at a time from the longest: a match of 3 is
    found in two scans ([4, 3]; bisecting tried [4, 1, 2, 3]), none in four at most."""
    import rollout.spec.ngram as ngram

    scans = []
    monkeypatch.setattr(ngram, "find_continuation", lambda source, pattern, k, hay=None: (
        scans.append(len(pattern)), find_continuation(source, pattern, k, hay))[1])
    cases = [([9, 1, 2, 3, 5, 8, 1, 2, 3], [4, 3], [5, 8]),  # the last 3 occur before; 4 do not
             ([1, 2, 3, 4, 5, 6, 7], [4, 3, 2, 1], [])]  # nothing repeats
    for tokens, want_scans, want in cases:
        seq = Sequence(0, "g", 0, tokens, SamplingParams(), 0, frozenset())
        scans.clear()
        drafts = NgramDrafter(1, 4).propose_batch([(seq, 2)], lambda s: [s])
        assert scans == want_scans and drafts == [(want, None)], (scans, drafts)
