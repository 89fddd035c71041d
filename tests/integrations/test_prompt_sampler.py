"""recipes/run/shard.PromptSampler: engines that draw different numbers of prompts a step
(partial rollouts and dynamic sampling draw what their carried and dropped groups leave room
for) never draw the same row within an epoch, and each epoch covers every row once, against
a naive reading of the draws."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout_recipes.run.shard import PromptSampler


@settings(max_examples=200, deadline=None)
@given(engines=st.integers(1, 4), extra_rows=st.integers(0, 25), seed=st.integers(0, 3),
       counts=st.lists(st.lists(st.integers(0, 7), min_size=1, max_size=12), min_size=4,
                       max_size=4))
def test_engines_drawing_unevenly_never_overlap_within_an_epoch(engines, extra_rows, seed,
                                                                counts):
    rows = engines + extra_rows
    drawn = []
    for engine in range(engines):
        sampler = PromptSampler(rows, 2, engine, engines, seed)
        got = [r for c in counts[engine] for r in sampler.next(c)]
        assert len(got) == sum(counts[engine])
        own = len(range(engine, rows, engines))  # its share of an epoch
        drawn.append([got[i:i + own] for i in range(0, len(got), own)])  # by epoch
        # A rank of the same engine draws the same rows.
        twin = PromptSampler(rows, 2, engine, engines, seed)
        assert [r for c in counts[engine] for r in twin.next(c)] == got
    for epoch in range(max(len(d) for d in drawn)):
        seen = [r for d in drawn if epoch < len(d) for r in d[epoch]]
        assert len(seen) == len(set(seen))  # no row twice in an epoch, across engines
        if all(epoch < len(d) - 1 for d in drawn):  # every engine drew all of it
            assert sorted(seen) == list(range(rows))


def test_too_few_rows_for_the_engines_is_refused():
    with pytest.raises(ValueError, match="training set: 2 rows for 3 engines"):
        PromptSampler(2, 1, 0, 3, 0)
