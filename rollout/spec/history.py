"""Draft history: the finished samples of earlier calls, indexed for suffix matching
(SpeculativeConfig(method="suffix"), suffix.py).

RL revisits its prompts every epoch, and a policy that moves by small steps answers them much as
it did before: the continuation that most often followed the current sequence's longest
matching suffix in that history is a draft the target often accepts. Entries are the tail of the
prompt (so the first tokens of a completion can be drafted) and the completion. Each entry is
indexed twice: in the index of its prompt (searched first: the same question's earlier
answers) and in the global one. An index maps every `min_match`-gram to where it ended;
longer matches are found by comparing backwards from those positions, a token at a time for
all of them at once.

The entries lie in one token buffer, oldest first, each after a gap that no token equals (so a
comparison stops at an entry's start); a position is an offset in it. The history lives in
host memory (it survives sleep), bounded by `budget` tokens: the oldest entries go first, so
what was evicted is a prefix of the buffer and of every index's offsets, dropped when it makes
up half of them.
"""

from __future__ import annotations

import itertools
from array import array
from collections import Counter, OrderedDict

import numpy as np

# Positions examined per lookup, newest first: a frequent n-gram occurs everywhere, and the
# newest occurrences come from the nearest policy.
MAX_CANDIDATES = 256
GAP = -1  # before every entry: no token id


class DraftHistory:
    def __init__(self, budget: int, min_match: int, max_match: int) -> None:
        self.budget, self.min_match, self.max_match = budget, min_match, max_match
        self.entries: OrderedDict[int, tuple[int, int]] = OrderedDict()  # id -> (start, length)
        self.prompt_of: dict[int, int] = {}
        # gram -> offsets (int64, ascending) of the tokens that followed it
        self.global_index: dict[tuple[int, ...], array] = {}
        self.prompt_index: dict[int, dict[tuple[int, ...], array]] = {}
        self.prompt_entries: dict[int, int] = {}  # prompt -> entries held
        self.tokens = 0  # tokens held
        self.evicted = 0  # entries evicted under the budget
        self._ids = itertools.count()
        # The first max_match places are gaps: looking back from any position stays inside.
        self._flat = np.full(4 * max_match + 1024, GAP, dtype=np.int32)
        self._used = max_match

    def add(self, prompt: list[int], completion: list[int]) -> int | None:
        """Remember one finished sample; returns its entry id (None: nothing worth keeping)."""
        tokens = prompt[-self.max_match:] + completion
        n = len(tokens)
        if not completion or n > self.budget:
            return None
        while self.entries and self.tokens + n > self.budget:
            self._evict_oldest()
        self._compact()
        start = self._reserve(n + 1)
        self._flat[start:start + n] = tokens
        eid, key = next(self._ids), hash(tuple(prompt))
        self.entries[eid], self.prompt_of[eid] = (start, n), key
        self.tokens += n
        own = self.prompt_index.setdefault(key, {})
        self.prompt_entries[key] = self.prompt_entries.get(key, 0) + 1
        m = self.min_match
        for end in range(m, n):  # only grams followed by something
            gram = tuple(tokens[end - m:end])
            for index in (self.global_index, own):
                held = index.get(gram)
                if held is None:
                    index[gram] = held = array("q")
                held.append(start + end)
        return eid

    def clear(self) -> None:
        self.__init__(self.budget, self.min_match, self.max_match)

    def _reserve(self, n: int) -> int:
        """Room for n more places at the end of the buffer (a gap follows each entry)."""
        start = self._used
        if start + n > len(self._flat):
            grown = np.full(max(2 * len(self._flat), start + n), GAP, dtype=np.int32)
            grown[:start] = self._flat[:start]
            self._flat = grown
        self._used = start + n
        return start

    def _evict_oldest(self) -> None:
        eid, (start, n) = self.entries.popitem(last=False)
        self.tokens -= n
        key = self.prompt_of.pop(eid)
        self.prompt_entries[key] -= 1
        if not self.prompt_entries[key]:
            del self.prompt_entries[key], self.prompt_index[key]
        self.evicted += 1

    def _compact(self) -> None:
        """Drop the evicted entries' places once they are half of the buffer: what is held
        moves down, and every offset with it."""
        live = self._live
        dead = live - self.max_match
        if dead <= self._used - live + 1024:
            return
        held = self._used - live
        self._flat[self.max_match:self.max_match + held] = self._flat[live:self._used]
        self._flat[self.max_match + held:self._used] = GAP
        for index in (self.global_index, *self.prompt_index.values()):
            for gram in list(index):
                kept = self._live_offsets(index[gram])
                if len(kept):
                    index[gram] = _int64s(kept - dead)
                else:
                    del index[gram]
        self.entries = OrderedDict((e, (s - dead, n)) for e, (s, n) in self.entries.items())
        self._used -= dead

    @property
    def _live(self) -> int:
        """Where the oldest entry held starts: offsets below it are the evicted entries'."""
        return next(iter(self.entries.values()))[0] if self.entries else self._used

    def _live_offsets(self, held: array) -> np.ndarray:
        """An index's offsets of entries still held (a view of its array)."""
        offsets = np.frombuffer(held, dtype=np.int64)
        return offsets[np.searchsorted(offsets, self._live):]

    # --- matching -----------------------------------------------------------------------------
    def matches(self, context: list[int], prompt: list[int] | None = None
                ) -> tuple[int, np.ndarray]:
        """(length, positions) of the longest suffix of `context` (min_match .. max_match
        tokens) that occurs in the history followed by something: in the entries of `prompt`
        when it has any match there, else in all. Positions, newest first: offsets of the
        token that followed in the buffer (`entries` gives each entry's start)."""
        none = np.empty(0, dtype=np.int64)
        if len(context) < self.min_match:
            return 0, none
        gram = tuple(context[-self.min_match:])
        indexes = [self.global_index]
        own = None if prompt is None else self.prompt_index.get(hash(tuple(prompt)))
        if own is not None:
            indexes.insert(0, own)
        span = min(self.max_match, len(context))
        for index in indexes:
            held = index.get(gram)
            if held is None:
                continue
            best = self._live_offsets(held)[-MAX_CANDIDATES:]
            if not len(best):
                continue
            # One token further back at a time, keeping the candidates that still agree with
            # the context (a gap ends a match at its entry's start): those left when none
            # would are the longest matches.
            n = self.min_match
            while n < span:
                agree = best[self._flat[best - n - 1] == context[-n - 1]]
                if not len(agree):
                    break
                best, n = agree, n + 1
            return n, best[::-1].copy()  # (a view would pin the index's array)
        return 0, none

    def continuation(self, positions: np.ndarray, k: int, min_share: float) -> list[int]:
        """Up to k tokens: at each step the token that most of the still-agreeing positions
        continue with (ties: the one the newest position continues with), while its share of
        all the positions stays at least `min_share`."""
        draft: list[int] = []
        alive, total = positions, len(positions)
        for j in range(k):
            following = self._flat[alive + j]
            counts = Counter(following.tolist())
            counts.pop(GAP, None)  # entries that ended
            if not counts:
                break
            token, count = counts.most_common(1)[0]  # the first counted among the most common
            if count < min_share * total:
                break
            draft.append(token)
            alive = alive[following == token]
        return draft


def _int64s(values: np.ndarray) -> array:
    out = array("q")
    out.frombytes(np.ascontiguousarray(values, dtype=np.int64).tobytes())
    return out
