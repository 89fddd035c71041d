"""N-gram drafting: continue the newest n tokens the way they continued before, looking in the
sample's own tokens and in its siblings (the other samples of the same prompt), which in RL
rollouts often repeat each other."""

from __future__ import annotations

from array import array

from ..requests.sequence import Sequence
from .drafter import Drafter


def find_continuation(source: list[int], pattern: list[int], k: int) -> list[int]:
    """Up to k tokens that followed the newest occurrence of `pattern` in `source` that has a
    continuation (so a pattern that is source's own tail does not find itself).

    The search runs as a bytes search over int32 arrays, at C speed; a hit at an offset that
    is not a multiple of 4 straddles two tokens and is skipped.
    """
    hay = array("i", source[:-1]).tobytes()
    needle = array("i", pattern).tobytes()
    end = len(hay)
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


class NgramDrafter(Drafter):
    def __init__(self, ngram_min: int, ngram_max: int) -> None:
        self.ngram_min, self.ngram_max = ngram_min, ngram_max

    def propose_batch(self, wanted: list[tuple[Sequence, int]], siblings):
        """[(draft, None)] per (sequence, k): n-gram proposals are deterministic (q one-hot)."""
        return [(self.propose(seq, siblings(seq), k), None) for seq, k in wanted]

    def propose(self, seq: Sequence, siblings: list[Sequence], k: int) -> list[int]:
        """Longest n first; the sample's own tokens before its siblings'."""
        tokens = seq.token_ids
        sources = [tokens] + [s.token_ids for s in siblings if s is not seq]
        for n in range(min(self.ngram_max, len(tokens) - 1), self.ngram_min - 1, -1):
            pattern = tokens[-n:]
            for source in sources:
                found = find_continuation(source, pattern, k)
                if found:
                    return found
        return []
