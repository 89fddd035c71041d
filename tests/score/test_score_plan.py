"""ScorePlan against a naive reference: with rows that are a known function of the prefix they
depend on, every sequence's wanted rows equal the naive computation, whatever the sharing
(random prefixes, duplicates, prefixes of each other, starts), and never more rows are computed
than scoring each sequence alone would."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout.score.plan import ScorePlan
from rollout.score.state import ScoreRows


def row(prefix: tuple[int, ...]) -> float:
    """Row p of a sequence depends on tokens 0 .. p + 1 only: a function of that prefix."""
    return float(hash(prefix) % 1000003)


def naive(seq: list[int]) -> list[float]:
    return [row(tuple(seq[:p + 2])) for p in range(len(seq) - 1)]


@st.composite
def calls(draw):
    stems = draw(st.lists(st.lists(st.integers(0, 3), min_size=0, max_size=6), min_size=1,
                          max_size=3))
    seqs = []
    for _ in range(draw(st.integers(1, 9))):
        stem = draw(st.sampled_from(stems))
        cut = draw(st.integers(0, len(stem)))
        seqs.append(stem[:cut] + draw(st.lists(st.integers(0, 3), max_size=5)))
    seqs = [s or [0] for s in seqs]
    starts = [draw(st.integers(1, len(s))) for s in seqs]
    return seqs, starts


@settings(max_examples=300, deadline=None)
@given(calls())
def test_rows_equal_the_naive_ones_and_are_computed_at_most_once(call):
    seqs, starts = call
    plan = ScorePlan(seqs, starts, top=1)
    computed, rounds = 0, 0
    while not plan.finished:
        rounds += 1
        assert rounds <= len(seqs) + 1
        chosen = plan.next_round()
        for i, prefix in chosen:
            rows = naive(seqs[i])
            first = len(prefix)
            assert first < len(rows)  # something is left to compute
            # What the plan copied is right where it is wanted.
            got = prefix.logprobs[starts[i] - 1:].tolist()
            assert got == rows[starts[i] - 1:first]
            new = torch.tensor(rows[first:])
            computed += len(new)
            plan.finish(i, ScoreRows.cat([prefix, ScoreRows(
                new, torch.zeros(len(new), 1, dtype=torch.long), torch.zeros(len(new), 1))]))
    for i, seq in enumerate(seqs):
        assert plan.results[i].logprobs[starts[i] - 1:].tolist() == naive(seq)[starts[i] - 1:]
    assert computed <= sum(len(s) - st for s, st in zip(seqs, starts))


def test_completions_of_one_prompt_take_two_rounds():
    prompt = list(range(20))
    seqs = [prompt + [100 + j, 7, 8] for j in range(5)]
    plan = ScorePlan(seqs, [1] * 5, top=0)
    first = plan.next_round()
    assert [i for i, _ in first] == [0] and len(first[0][1]) == 0
    plan.finish(0, ScoreRows.empty(len(seqs[0]) - 1, 0))
    second = plan.next_round()
    assert sorted(i for i, _ in second) == [1, 2, 3, 4]
    # Rows 0 .. 18 (tokens 1 .. 19) are shared; row 19 (token 20, the first to differ) runs.
    assert all(len(prefix) == 19 for _, prefix in second)
