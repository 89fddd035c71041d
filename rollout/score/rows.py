"""Scored rows from hidden states: log_softmax(logits / T) at each row's target, and its top-k.

The LM head runs over blocks of rows, so a long sequence never holds [L, V] logits at once."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..sample.log_softmax import log_softmax
from ..sample.ranked import top_ranked
from .state import ScoreRows

# Logits computed at once, in elements (float32: 64 MB), whatever the sequence's length.
LOGITS_BLOCK_ELEMENTS = 1 << 24


@dataclass
class ScoreInputs:
    """The rows a step scores: flat positions of the step, what each scores, at what
    temperature, and how many rows each item of the batch has (0 for the others)."""

    index: torch.Tensor  # int64 [R], into the step's flat tokens
    targets: torch.Tensor  # int64 [R]
    temperature: torch.Tensor  # float32 [R]
    top: int
    counts: list[int]


def score_inputs(items, device: torch.device) -> ScoreInputs | None:
    """The rows a step's items score: each scored sequence's positions from its first unknown
    row on (those below it ran only for their K/V: a cache miss on a prefix whose rows the call
    copied)."""
    if all(it.seq.score is None for it in items):  # a rollout's step: one pass, no lists
        return None
    index, targets, temperature, counts, top, offset = [], [], [], [], 0, 0
    for it in items:
        state, end = it.seq.score, it.start + it.num_new
        first = end if state is None else max(it.start, state.filled)
        count = max(0, end - first)
        if count:
            index += range(offset + first - it.start, offset + end - it.start)
            targets += state.targets[first:end]
            temperature += [state.temperature] * count
            top = max(top, state.top)
        counts.append(count)
        offset += it.num_new
    if not index:
        return None
    return ScoreInputs(torch.tensor(index, dtype=torch.long, device=device),
                       torch.tensor(targets, dtype=torch.long, device=device),
                       torch.tensor(temperature, dtype=torch.float32, device=device),
                       top, counts)


def score_rows(compute_logits, hidden: torch.Tensor, rows: ScoreInputs,
               vocab_size: int) -> ScoreRows:
    """`compute_logits(hidden [N, H]) -> fp32 logits [N, V]`, the model's; on the host."""
    block = max(1, LOGITS_BLOCK_ELEMENTS // vocab_size)
    parts = []
    for i in range(0, rows.index.numel(), block):
        span = slice(i, i + block)
        logits = compute_logits(hidden[rows.index[span]]).float()
        temperature = rows.temperature[span]
        if not bool((temperature == 1).all()):  # x / 1 == x: skip a pass over [N, V]
            logits = logits / temperature[:, None]
        logp = log_softmax(logits)
        chosen = logp.gather(-1, rows.targets[span, None]).squeeze(-1)
        ids, values = top_ranked(logp, rows.top)  # k = 0 gives [N, 0]
        parts.append(ScoreRows(chosen, ids, values))
    return ScoreRows.cat(parts).to("cpu")
