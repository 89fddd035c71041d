"""N-gram drafting: continue the newest n tokens the way they continued before, looking in the
sample's own tokens and in its siblings (the other samples of the same prompt), which in RL
rollouts often repeat each other."""

from __future__ import annotations

from array import array

from ..requests.sequence import Sequence
from .drafter import Drafter

# Up to this many lengths below the longest, they are tried one by one downwards (the default
# 1-4: at most as many scans as bisection's worst, and fewer where a long match is found);
# over a wider range the longest matching length is bisected.
LINEAR_SPAN = 3


def find_continuation(source: list[int], pattern: list[int], k: int,
                      hay: bytes | None = None) -> list[int]:
    """Up to k tokens that followed the newest occurrence of `pattern` in `source` that has a
    continuation (so a pattern that is source's own tail does not find itself).

    The search runs as a bytes search over int32 arrays, at C speed; a hit at an offset that
    is not a multiple of 4 straddles two tokens and is skipped. `hay`: `as_bytes(source)`,
    where the caller searches one source several times.
    """
    hay = as_bytes(source) if hay is None else hay
    needle = array("i", pattern).tobytes()
    end = max(len(hay) - 4, 0)  # (the newest token has no continuation)
    while True:
        at = hay.rfind(needle, 0, end)
        if at < 0:
            return []
        if at % 4 == 0:
            break
        end = at + len(needle) - 1
    # Copy forward; past the end of `source` keep copying from the proposal itself, so a loop
    # of period p still yields k tokens although only p - 1 follow its newest occurrence.
    start = at // 4 + len(pattern)
    proposal: list[int] = []
    for i in range(start, start + k):
        proposal.append(source[i] if i < len(source) else proposal[i - len(source)])
    return proposal


def as_bytes(tokens: list[int]) -> bytes:
    return array("i", tokens).tobytes()


class NgramDrafter(Drafter):
    def __init__(self, ngram_min: int, ngram_max: int) -> None:
        self.ngram_min, self.ngram_max = ngram_min, ngram_max

    def propose_batch(self, wanted: list[tuple[Sequence, int]], siblings):
        """[(draft, None)] per (sequence, k): n-gram proposals are deterministic (q one-hot)."""
        hays: dict[int, tuple[list[int], bytes]] = {}
        return [(self.search(seq, siblings(seq), k, hays)[0], None) for seq, k in wanted]

    def search(self, seq: Sequence, siblings: list[Sequence], k: int,
               hays: dict[int, tuple[list[int], bytes]]) -> tuple[list[int], int, str | None]:
        """(draft, the n it matched, "self" or "siblings"), or ([], 0, None): the longest n
        that occurs, the sample's own tokens before its siblings'. An occurrence of the last
        n + 1 tokens holds one of the last n, ending where it ends (so with the same token
        after it): whether some source holds the last n can only fail from some n on, found by
        bisection in O(log(ngram_max - ngram_min)) scans of the sources rather than one scan
        per n (a sample matching nowhere scanned them ngram_max times a step). `hays`: (token
        list, its bytes) by the list's id, built once in a step's proposals (they change no
        tokens; the list is held, so its id is not reused): a group's samples search one
        another."""
        tokens = seq.token_ids
        sources = [("self", tokens)] + [("siblings", s.token_ids) for s in siblings
                                        if s is not seq]

        def first_at(n: int) -> tuple[list[int], int, str | None] | None:
            """The draft of the first source holding the last n tokens, if any does."""
            pattern = tokens[-n:]
            for name, source in sources:
                if id(source) not in hays:
                    hays[id(source)] = source, as_bytes(source)
                found = find_continuation(source, pattern, k, hays[id(source)][1])
                if found:
                    return found, n, name
            return None

        low, high = self.ngram_min, min(self.ngram_max, len(tokens) - 1)
        if high < low:
            return [], 0, None
        # The longest first: repetitive text matches there, in one scan.
        best = first_at(high)
        if best is not None:
            return best
        if high - low <= LINEAR_SPAN:
            # A few lengths (the default 1-4): one at a time downwards scans no more than
            # bisecting would, and stops at the first length that matches.
            for n in range(high - 1, low - 1, -1):
                found = first_at(n)
                if found is not None:
                    return found
            return [], 0, None
        best = first_at(low)
        if best is None:
            return [], 0, None
        while high - low > 1:  # found at low, not at high
            mid = (low + high) // 2
            found = first_at(mid)
            if found is None:
                high = mid
            else:
                best, low = found, mid
        return best
