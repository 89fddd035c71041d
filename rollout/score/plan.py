"""Which sequences of one score() call run in which round, and what each knows beforehand.

Row p of a sequence (the logprob of token p + 1) depends on tokens 0 .. p + 1 alone, so two
sequences sharing their first m tokens share rows 0 .. m - 2. The K/V of a shared prefix comes
from the radix cache, but its rows do not: a cache hit skips the forward that computes them. So
a sequence that shares a long prefix with another waits for that one to finish (a round
later), copies the shared rows from its result, and runs only its own positions on top of the
cached K/V. "Long" is the scheduler's rule for prompts: the wait saves at least half of what the
sequence would compute; a sequence that is a prefix of the next always waits. Sorted sequences make every lookup local: the sequence sharing the
longest prefix with s among any set is s's nearest neighbour in sort order within that set.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

from ..kv.radix_cache import common_prefix_len
from .state import ScoreRows


class ScorePlan:
    def __init__(self, sequences: list[list[int]], starts: list[int], top: int) -> None:
        """`starts[i]`: the first token of sequence i whose logprob is wanted (>= 1); rows
        below starts[i] - 1 are never computed for it."""
        self.sequences, self.starts, self.top = sequences, starts, top
        self.order = sorted(range(len(sequences)), key=sequences.__getitem__)
        self.rank = {i: r for r, i in enumerate(self.order)}
        self.results: dict[int, ScoreRows] = {}
        self._done: list[int] = []  # ranks of the finished sequences, ascending
        self._pending = list(range(len(sequences)))  # ranks

    @property
    def finished(self) -> bool:
        return not self._pending

    def next_round(self) -> list[tuple[int, ScoreRows]]:
        """(sequence index, rows known before its forward) of every sequence to run now.
        Sequences whose rows are all known already finish here."""
        chosen, deferred, last = [], [], None
        for at, r in enumerate(self._pending):
            i = self.order[r]
            prefix = self._known(r)
            total = len(self.sequences[i]) - 1
            if len(prefix) == total:
                self.finish(i, prefix)
                continue
            after = self._pending[at + 1] if at + 1 < len(self._pending) else None
            if after is not None and self._reach(self.order[after], i) == total:
                deferred.append(r)  # a prefix of the next one: its rows all come with that
                continue
            if last is not None:
                gain = self._reach(last, i) - len(prefix)
                if gain > 0 and 2 * gain >= total - len(prefix):
                    deferred.append(r)
                    continue
            chosen.append((i, prefix))
            last = i
        self._pending = deferred
        return chosen

    def finish(self, index: int, rows: ScoreRows) -> None:
        self.results[index] = rows
        bisect.insort(self._done, self.rank[index])

    def _known(self, r: int) -> ScoreRows:
        """Rows of sequence order[r] known now: those below its start (never computed), or a
        finished sequence's rows for the prefix they share, whichever reach further."""
        i = self.order[r]
        unwanted = self.starts[i] - 1
        best, source = unwanted, None
        k = bisect.bisect_left(self._done, r)
        for c in (self.order[d] for d in self._done[max(0, k - 1):k + 1]):
            reach = self._reach(c, i)
            if reach > best:
                best, source = reach, c
        if source is None:
            return ScoreRows.empty(unwanted, self.top)
        return self.results[source][:best]

    def _reach(self, source: int, i: int) -> int:
        """Rows of sequence i that sequence `source`'s result holds: those of their common
        prefix, when source's rows start no later than i's (its rows below its start are
        empty)."""
        if self.starts[source] > self.starts[i]:
            return 0
        return _shared(self.sequences[source], self.sequences[i]) - 1


def _shared(a: Sequence[int], b: Sequence[int]) -> int:
    if len(a) > len(b):
        a, b = b, a
    return common_prefix_len(a, b, 0)
