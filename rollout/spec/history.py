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

Changes are journaled (journal.py): inside a unit each eviction, compaction, reservation and
addition records its inverse, so a failed flush (suffix.py) leaves the history as it was, no
sample in it half or twice.
"""

from __future__ import annotations

import bisect
import functools
import itertools
from array import array
from collections import Counter, OrderedDict

import numpy as np

from ..journal import Journal

# Positions examined per lookup, newest first: a frequent n-gram occurs everywhere, and the
# newest occurrences come from the nearest policy.
MAX_CANDIDATES = 256
GAP = -1  # before every entry: no token id
# Evicted places are dropped once they outnumber the held ones by this many: compaction copies
# everything held, so it waits until there is enough to drop.
COMPACT_SLACK = 1024
# Places for entries in a new buffer, past its leading gaps: it grows (doubling) as entries
# come, so an empty history holds about nothing whatever its budget.
START_ROOM = 1024


class DraftHistory:
    def __init__(self, budget: int, min_match: int, max_match: int,
                 journal: Journal | None = None) -> None:
        self.budget, self.min_match, self.max_match = budget, min_match, max_match
        self.journal = Journal() if journal is None else journal  # (its own: never recording)
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
        self._flat = np.full(max_match + START_ROOM, GAP, dtype=np.int32)
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
        eid, key = next(self._ids), hash(tuple(prompt))
        # Recorded before the first change: an append can fail (memory) with the entry half
        # in, and the undo takes back whatever of it is there.
        self.journal.record(functools.partial(self._unadd, eid, key, start, tokens, self.tokens,
                                              self.prompt_entries.get(key, 0)))
        self._flat[start:start + n] = tokens
        self.entries[eid], self.prompt_of[eid] = (start, n), key
        self.tokens += n
        own = self.prompt_index.setdefault(key, {})
        self.prompt_entries[key] = self.prompt_entries.get(key, 0) + 1
        m = self.min_match
        # As _grams, inline: through the generator an add took 115-118 against 104-106 us
        # (6,000 samples of 250-600 tokens, best of 5, AMD EPYC Zen 4).
        for end in range(m, n):
            gram = tuple(tokens[end - m:end])
            for index in (self.global_index, own):
                held = index.get(gram)
                if held is None:
                    index[gram] = held = array("q")
                held.append(start + end)
        return eid

    def _grams(self, tokens: list[int]):
        """(min_match-gram, where the token after it is in the entry), for the grams followed
        by something."""
        m = self.min_match
        return ((tuple(tokens[end - m:end]), end) for end in range(m, len(tokens)))

    def _unadd(self, eid: int, key: int, start: int, tokens: list[int], held_tokens: int,
               prompt_entries: int) -> None:
        """Undo add(), all of it or the part done before it failed. Undos run newest first, so
        the history is as add() left it: the offsets it appended are the last of their arrays,
        above every other (its place was at the end of the buffer, given back by _reserve's
        undo, next)."""
        self.entries.pop(eid, None)
        self.prompt_of.pop(eid, None)
        self.tokens = held_tokens
        indexes = [self.global_index]
        if prompt_entries:
            self.prompt_entries[key] = prompt_entries
            indexes.append(self.prompt_index[key])
        else:  # the prompt's first entry: its index goes whole
            self.prompt_entries.pop(key, None)
            self.prompt_index.pop(key, None)
        for gram, after in reversed(list(self._grams(tokens))):
            for index in indexes:
                held = index.get(gram)
                if held is None:
                    continue
                if held and held[-1] == start + after:
                    held.pop()
                if not held:
                    del index[gram]
        self._flat[start:start + len(tokens)] = GAP

    def clear(self) -> None:
        evicted = self.evicted  # a count over the engine's life, as its other stats: kept
        self.__init__(self.budget, self.min_match, self.max_match, self.journal)
        self.evicted = evicted

    def check(self) -> None:
        """The indexes hold exactly the grams of the entries held (rebuilt here from the
        buffer), each entry between gaps, the counts agree, the budget holds."""
        want_global: dict = {}
        want_own: dict = {}
        end = self._live  # where the next entry may start
        for eid, (start, n) in self.entries.items():
            assert start >= end and self._flat[start - 1] == GAP, "entries overlap"
            tokens = self._flat[start:start + n].tolist()
            assert GAP not in tokens, "a gap inside an entry"
            own = want_own.setdefault(self.prompt_of[eid], {})
            for gram, after in self._grams(tokens):
                for index in (want_global, own):
                    index.setdefault(gram, []).append(start + after)
            end = start + n + 1  # past its gap
        assert end == self._used and (self._flat[end - 1:] == GAP).all(), "the buffer's end"
        # (grams with only evicted entries' offsets are left until compaction drops them)
        live = {key: {gram: kept.tolist() for gram, offsets in index.items()
                      if len(kept := self._live_offsets(offsets))}
                for key, index in [(None, self.global_index), *self.prompt_index.items()]}
        assert live == {None: want_global, **want_own}, "indexes differ from the entries"
        assert self.prompt_entries == Counter(self.prompt_of.values()), "entry counts"
        assert set(self.prompt_of) == set(self.entries), "prompts of entries"
        assert self.tokens == sum(n for _, n in self.entries.values()) <= self.budget, "tokens"

    def _reserve(self, n: int) -> int:
        """Room for n more places at the end of the buffer (a gap follows each entry)."""
        start = self._used
        if start + n > len(self._flat):
            grown = np.full(max(2 * len(self._flat), start + n), GAP, dtype=np.int32)
            grown[:start] = self._flat[:start]
            self._flat = grown  # (kept by the undo: the same places, more room)
        self._used = start + n
        self.journal.record(functools.partial(setattr, self, "_used", start))
        return start

    def _evict_oldest(self) -> None:
        eid, (start, n) = self.entries.popitem(last=False)
        self.tokens -= n
        key = self.prompt_of.pop(eid)
        self.prompt_entries[key] -= 1
        own = None  # the prompt's index, when this was its last entry
        if not self.prompt_entries[key]:
            del self.prompt_entries[key]
            own = self.prompt_index.pop(key)
        self.evicted += 1
        self.journal.record(functools.partial(self._unevict, eid, start, n, key, own))

    def _unevict(self, eid: int, start: int, n: int, key: int, own: dict | None) -> None:
        """Undo _evict_oldest(): its places and offsets are still in the buffer and indexes
        (only compaction drops them, and its undo ran first)."""
        self.entries[eid] = (start, n)
        self.entries.move_to_end(eid, last=False)
        self.prompt_of[eid] = key
        self.prompt_entries[key] = self.prompt_entries.get(key, 0) + 1
        if own is not None:
            self.prompt_index[key] = own
        self.tokens += n
        self.evicted -= 1

    def _compact(self) -> None:
        """Drop the evicted entries' places once they are half of the buffer: what is held
        moves down, and every offset with it. Into new structures, so the undo puts the old
        ones back."""
        live = self._live
        dead = live - self.max_match
        if dead <= self._used - live + COMPACT_SLACK:
            return
        held = self._used - live
        flat = np.full(len(self._flat), GAP, dtype=np.int32)
        flat[self.max_match:self.max_match + held] = self._flat[live:self._used]

        def moved(index: dict) -> dict:
            kept = ((gram, self._live_offsets(offsets)) for gram, offsets in index.items())
            return {gram: _int64s(offsets - dead) for gram, offsets in kept if len(offsets)}
        layout = (flat, self._used - dead, moved(self.global_index),
                  {key: moved(index) for key, index in self.prompt_index.items()},
                  OrderedDict((e, (s - dead, n)) for e, (s, n) in self.entries.items()))
        self.journal.record(functools.partial(self._set_layout, self._layout()))
        self._set_layout(layout)

    def _layout(self) -> tuple:
        return self._flat, self._used, self.global_index, self.prompt_index, self.entries

    def _set_layout(self, layout: tuple) -> None:
        self._flat, self._used, self.global_index, self.prompt_index, self.entries = layout

    @property
    def _live(self) -> int:
        """Where the oldest entry held starts: offsets below it are the evicted entries'."""
        return next(iter(self.entries.values()))[0] if self.entries else self._used

    def _live_offsets(self, held: array, newest: int | None = None) -> np.ndarray:
        """An index's offsets of entries still held (only the newest `newest` of them), copied:
        while a view of `held` lives (in an exception's traceback, say) it cannot grow."""
        first = bisect.bisect_left(held, self._live)
        if newest is not None:
            first = max(first, len(held) - newest)
        return np.frombuffer(held[first:], dtype=np.int64)

    # --- matching -----------------------------------------------------------------------------
    def matches(self, context: list[int], prompt: list[int]) -> tuple[int, np.ndarray]:
        """(length, positions) of the longest suffix of `context` (min_match .. max_match
        tokens) that occurs in the history followed by something: in the entries of `prompt`
        when it has any match there, else in all. Positions, newest first: offsets of the
        token that followed in the buffer (`entries` gives each entry's start)."""
        none = np.empty(0, dtype=np.int64)
        if len(context) < self.min_match:
            return 0, none
        gram = tuple(context[-self.min_match:])
        indexes = [self.global_index]
        own = self.prompt_index.get(hash(tuple(prompt)))
        if own is not None:
            indexes.insert(0, own)
        span = min(self.max_match, len(context))
        for index in indexes:
            held = index.get(gram)
            if held is None:
                continue
            best = self._live_offsets(held, MAX_CANDIDATES)
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
            return n, best[::-1]
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
