"""Stop conditions checked after every appended token."""

from __future__ import annotations

from ..requests.sequence import Sequence


class StopChecker:
    def __init__(self, max_model_len: int, tokenizer=None) -> None:
        self.max_model_len = max_model_len
        self.tokenizer = tokenizer
        self._lengths: dict[int, int] = {}  # token id -> characters it decodes to alone

    def check(self, seq: Sequence, tokens: list[int]) -> tuple[int, str | None, int | None]:
        """As if `tokens` were appended one at a time to `seq.token_ids`, without touching `seq`:
        (how many of them are kept, up to and including the one a stop condition fires at;
        the finish reason or None; where the matched stop string starts in the output text)."""
        params = seq.params
        first, start = len(seq.token_ids), len(seq.prompt_ids)
        # Stop ids and lengths fire at a token known without decoding: the length at the
        # room-th token appended (max_tokens outputs, or max_model_len tokens in all).
        room = min(params.max_tokens - (first - start), self.max_model_len - first)
        limit, reason = len(tokens), None
        for i, token in enumerate(tokens):
            if token in seq.stop_ids:
                reason = "stop"
            elif i + 1 >= room:
                reason = "length"
            if reason:
                limit = i + 1
                break
        if params.stop:
            # A stop string can fire before that token, or at it: instead of "length", or
            # beside a stop id whose text completes it (stop=["\n"], stop_token_ids=[its id]),
            # which then cuts the text too.
            ids = _Joined(seq.token_ids, list(tokens))
            hit = self._stop_string(ids, start, first, first + limit, seq.params.stop)
            if hit:
                return hit[0] - first, "stop", hit[1]
        return limit, reason, None

    def _stop_string(self, ids: _Joined, start: int, first: int, last: int,
                     stops: list[str]) -> tuple[int, int] | None:
        """The first end in first+1..last at which a stop string is in the output text
        `ids[start:end]`, and where the earliest one starts; None if there is none (and none is
        in `ids[start:first]`)."""
        ends = range(first + 1, last + 1)
        # One window over all the new tokens rules them all out, unless a stop string holds
        # U+FFFD: a character completed by a later token can take that text back.
        if len(ends) > 1 and not any("\ufffd" in s for s in stops) and \
                not self._in_window(ids, start, first, last, stops):
            return None
        for end in ends:
            if self._in_window(ids, start, end - 1, end, stops):
                # Only the whole text gives the offset (and the final word, should a decoder's
                # window text not quite be its suffix): decode it, once, on a match.
                text = self.decode(ids[start:end])
                found = [i for i in (text.find(s) for s in stops) if i >= 0]
                if found:
                    return end, min(found)
        return None

    def _in_window(self, ids: _Joined, start: int, first: int, end: int, stops: list[str]) -> bool:
        """Whether a stop string is in the output text `ids[start:end]`, given that none is in
        `ids[start:first]`; from a short window of the last tokens.

        Stop strings match the text the caller gets (`Sample.text`, special tokens skipped). A
        window may start inside a character, whose bytes there decode to U+FFFD; from the next
        character on its text is the whole text's (UTF-8 decoded with replacement, as byte-level
        decoders do), so without its leading U+FFFDs it is a suffix of the caller's text. Each
        new token changes at most as many characters at the end as it decodes to alone (the
        character it completes and its own), one more where a decoder strips a leading space
        from what it decodes (SentencePiece), so a new match lies in the last len(longest) - 1
        + that many. The window widens until that much is decoded, counted in characters: a
        character may take several tokens, and skipped special tokens take none.
        """
        longest = max(len(s) for s in stops)
        need = longest - 1 + sum(self._length(t) + 1 for t in ids[first:end])
        span = 2 * need  # tokens: most are a character or more, some a byte of one
        while True:
            a = max(end - span, start)
            tail = self.decode(ids[a:end])
            if a > start:
                tail = tail.lstrip("\ufffd")
            if a == start or len(tail) >= need:
                return any(s in tail for s in stops)
            span *= 2

    def _length(self, token: int) -> int:
        """How many characters `token` decodes to alone."""
        if token not in self._lengths:
            self._lengths[token] = len(self.decode([token]))
        return self._lengths[token]

    def decode(self, token_ids: list[int]) -> str:
        """The text of `token_ids` as the caller sees it."""
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)


class _Joined:
    """`base + extra` for indexing and slicing, without copying `base` (a whole sequence)."""

    def __init__(self, base: list[int], extra: list[int]) -> None:
        self.base, self.extra = base, extra

    def __len__(self) -> int:
        return len(self.base) + len(self.extra)

    def __getitem__(self, key):
        n = len(self.base)
        if isinstance(key, slice):  # start and stop given, in range
            return self.base[key.start:key.stop] + self.extra[max(key.start - n, 0):
                                                              max(key.stop - n, 0)]
        return self.base[key] if key < n else self.extra[key - n]
