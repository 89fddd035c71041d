"""Stop conditions checked after every appended token."""

from __future__ import annotations

from .request import Sequence


class StopChecker:
    def __init__(self, max_model_len: int, tokenizer=None) -> None:
        self.max_model_len = max_model_len
        self.tokenizer = tokenizer

    def __call__(self, seq: Sequence) -> str | None:
        """The finish reason after the newest token, or None to go on."""
        token = seq.token_ids[-1]
        if token in seq.stop_ids:
            return "stop"
        if seq.params.stop and self._stop_string(seq):
            return "stop"
        if seq.num_output >= seq.params.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _stop_string(self, seq: Sequence) -> bool:
        # Stop strings match the text the caller gets (`Sample.text`, special tokens skipped).
        # One ends in the newest token; a window of the last few tokens is enough to see it,
        # since every other token decodes to at least one character (or a byte of one), unless
        # special tokens in the window decode to nothing: then the window is the whole output.
        longest = max(len(s) for s in seq.params.stop)
        window = seq.output_ids[-(longest + 4):]
        tail = self.decode(window)
        whole = len(window) == len(seq.output_ids)
        if not whole and len(tail) < longest:
            tail, whole = self.decode(seq.output_ids), True
        if not any(s in tail for s in seq.params.stop):
            return False
        text = tail if whole else self.decode(seq.output_ids)
        seq.stop_text_at = min(i for i in (text.find(s) for s in seq.params.stop) if i >= 0)
        return True

    def decode(self, token_ids: list[int]) -> str:
        """The text of `token_ids` as the caller sees it."""
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)
