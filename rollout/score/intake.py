"""score()'s arguments checked completely before anything is queued: a bad one raises
ValueError naming the field and its limit, and the engine keeps serving the others."""

from __future__ import annotations

from ..fields import as_float, as_int
from ..requests.intake import token_ids
from ..sample.params import MAX_TEMPERATURE, MAX_TOP_LOGPROBS, MIN_TEMPERATURE


def check_scores(sequences, temperature, top_logprobs, start, vocab_size: int,
                 max_model_len: int, tokenizer) -> tuple[list[list[int]], list[int], float, int]:
    """(token ids per sequence, first scored token per sequence, temperature, top k)."""
    if isinstance(sequences, str) or not isinstance(sequences, (list, tuple)):
        raise ValueError("sequences must be a list of strings or of token-id lists")
    ids = [token_ids(f"sequences[{i}]", s, vocab_size, tokenizer, max_model_len,
                     f"max_model_len={max_model_len}")[1]
           for i, s in enumerate(sequences)]
    temperature = as_float("temperature", temperature)
    if not MIN_TEMPERATURE <= temperature <= MAX_TEMPERATURE:
        raise ValueError(f"temperature must be in [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}], "
                         f"got {temperature}")
    top = as_int("top_logprobs", top_logprobs, 0, MAX_TOP_LOGPROBS)
    if top > vocab_size:
        raise ValueError(f"top_logprobs must be at most the vocabulary ({vocab_size}), got {top}")
    if getattr(start, "ndim", 0) == 1:  # a tensor or array of starts, as sequences may be
        start = start.tolist()
    starts = start if isinstance(start, (list, tuple)) else [start] * len(ids)
    if len(starts) != len(ids):
        raise ValueError(f"start: {len(starts)} values for {len(ids)} sequences")
    starts = [as_int(f"start[{i}]", s, 1) for i, s in enumerate(starts)]
    for i, (s, seq) in enumerate(zip(starts, ids)):
        if s > len(seq):
            raise ValueError(f"start[{i}] must be at most the sequence's length "
                             f"{len(seq)}, got {s}")
    return ids, starts, temperature, top
