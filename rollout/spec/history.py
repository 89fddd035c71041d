"""Draft history: the finished samples of earlier calls, indexed for suffix matching
(SpeculativeConfig(method="suffix"), suffix.py).

RL revisits its prompts every epoch, and a policy that moves by small steps answers them much as
it did before: the continuation that most often followed the current sequence's longest
matching suffix in that history is a draft the target often accepts. Entries are the tail of the
prompt (so the first tokens of a completion can be drafted) and the completion. Each entry is
indexed twice: in the index of its prompt (searched first: the same question's earlier
answers) and in the global one. An index maps every `min_match`-gram to where it ended;
longer matches are found by comparing backwards from those positions.

The history lives in host memory (it survives sleep), bounded by `budget` tokens: the oldest
entries go first. Evicted entries are skipped at lookup and dropped from the indexes when they
make up half of them.
"""

from __future__ import annotations

import itertools
from array import array
from collections import OrderedDict

# Positions examined per lookup, newest first: a frequent n-gram occurs everywhere, and the
# newest occurrences come from the nearest policy.
MAX_CANDIDATES = 256


class NgramIndex:
    """`min_match`-gram -> [(entry id, offset just past the gram)]."""

    def __init__(self, min_match: int) -> None:
        self.min_match = min_match
        self.positions: dict[tuple[int, ...], list[tuple[int, int]]] = {}
        self.size = 0

    def add(self, eid: int, tokens: array) -> None:
        n = self.min_match
        for end in range(n, len(tokens)):  # only grams followed by something
            self.positions.setdefault(tuple(tokens[end - n:end]), []).append((eid, end))
        self.size += max(0, len(tokens) - n)

    def lookup(self, gram: tuple[int, ...]) -> list[tuple[int, int]]:
        return self.positions.get(gram, [])

    def rebuild(self, entries: dict[int, array], eids) -> None:
        self.positions, self.size = {}, 0
        for eid in eids:
            if eid in entries:
                self.add(eid, entries[eid])


class DraftHistory:
    def __init__(self, budget: int, min_match: int, max_match: int) -> None:
        self.budget, self.min_match, self.max_match = budget, min_match, max_match
        self.entries: OrderedDict[int, array] = OrderedDict()  # oldest first
        self.prompt_of: dict[int, int] = {}
        self.global_index = NgramIndex(min_match)
        self.prompt_index: dict[int, NgramIndex] = {}
        self.prompt_entries: dict[int, list[int]] = {}
        self.tokens = 0  # tokens held
        self._live = 0  # index positions of the entries held
        self.evicted = 0  # entries evicted under the budget
        self._ids = itertools.count()

    def add(self, prompt: list[int], completion: list[int]) -> int | None:
        """Remember one finished sample; returns its entry id (None: nothing worth keeping)."""
        tokens = array("i", prompt[-self.max_match:] + completion)
        if not completion or len(tokens) > self.budget:
            return None
        while self.entries and self.tokens + len(tokens) > self.budget:
            self._evict_oldest()
        eid, key = next(self._ids), hash(tuple(prompt))
        self.entries[eid], self.prompt_of[eid] = tokens, key
        self.tokens += len(tokens)
        self._live += max(0, len(tokens) - self.min_match)
        self.global_index.add(eid, tokens)
        self.prompt_index.setdefault(key, NgramIndex(self.min_match)).add(eid, tokens)
        self.prompt_entries.setdefault(key, []).append(eid)
        return eid

    def remove(self, eid: int) -> None:
        tokens = self.entries.pop(eid)
        self.tokens -= len(tokens)
        self._live -= max(0, len(tokens) - self.min_match)
        key = self.prompt_of.pop(eid)
        self.prompt_entries[key].remove(eid)
        if not self.prompt_entries[key]:
            del self.prompt_entries[key], self.prompt_index[key]
        self._compact()

    def clear(self) -> None:
        self.__init__(self.budget, self.min_match, self.max_match)

    def _evict_oldest(self) -> None:
        self.remove(next(iter(self.entries)))
        self.evicted += 1

    def _compact(self) -> None:
        """Drop evicted positions once they are half of the global index."""
        if self.global_index.size > 2 * self._live + 1024:
            self.global_index.rebuild(self.entries, self.entries)
            for key, index in self.prompt_index.items():
                index.rebuild(self.entries, self.prompt_entries[key])

    # --- matching -----------------------------------------------------------------------------
    def matches(self, context: list[int], prompt: list[int] | None = None
                ) -> tuple[int, list[tuple[int, int]]]:
        """(length, positions) of the longest suffix of `context` (min_match .. max_match
        tokens) that occurs in the history followed by something: in the entries of `prompt`
        when it has any match there, else in all. Positions: (entry id, offset of the token
        that followed)."""
        if len(context) < self.min_match:
            return 0, []
        gram = tuple(context[-self.min_match:])
        indexes = [self.global_index]
        own = None if prompt is None else self.prompt_index.get(hash(tuple(prompt)))
        if own is not None:
            indexes.insert(0, own)
        for index in indexes:
            best, found = 0, []
            for eid, end in reversed(index.lookup(gram)[-MAX_CANDIDATES:]):
                tokens = self.entries.get(eid)
                if tokens is None:
                    continue
                n = self._match_len(tokens, end, context)
                if n > best:
                    best, found = n, [(eid, end)]
                elif n == best:
                    found.append((eid, end))
            if found:
                return best, found
        return 0, []

    def _match_len(self, tokens: array, end: int, context: list[int]) -> int:
        """How many tokens before `end` in `tokens` equal the tail of `context` (at most
        max_match; at least min_match, which the index matched)."""
        n = self.min_match
        limit = min(self.max_match, end, len(context))
        while n < limit and tokens[end - n - 1] == context[-n - 1]:
            n += 1
        return n

    def continuation(self, positions: list[tuple[int, int]], k: int, min_share: float
                     ) -> list[int]:
        """Up to k tokens: at each step the token that most of the still-agreeing positions
        continue with, while its share of all the positions stays at least `min_share`."""
        draft: list[int] = []
        alive = [(self.entries[eid], end) for eid, end in positions]
        total = len(alive)
        for j in range(k):
            counts: dict[int, int] = {}
            for tokens, end in alive:
                if end + j < len(tokens):
                    counts[tokens[end + j]] = counts.get(tokens[end + j], 0) + 1
            if not counts:
                break
            token, count = max(counts.items(), key=lambda kv: kv[1])
            if count < min_share * total:
                break
            draft.append(token)
            alive = [(t, e) for t, e in alive if e + j < len(t) and t[e + j] == token]
        return draft
