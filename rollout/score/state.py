"""What a scored sequence carries through the engine, and what score() returns.

A sequence t_0 .. t_{L-1} is scored by running positions 0 .. L-2 (its last token is never an
input): row p of the forward gives the logprob of t_{p+1}. Inside the engine it is a `Sequence`
whose tokens are t_0 .. t_{L-2}, prefilled and never sampled; its `ScoreState` collects the rows
in order. Rows below `filled` are known before the forward runs (the call's earlier results for
a shared prefix, or rows the caller does not want), so only K/V below `filled` may come from the
prefix cache: the rows above it need their positions run.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..journal import Journal


@dataclass
class TopLogprobs:
    """The `k` most likely tokens at each position, most likely first: `ids` int64 [N, k],
    `logprobs` float32 [N, k]; `top[j]` is position j's {token id: logprob}."""

    ids: torch.Tensor
    logprobs: torch.Tensor

    def __len__(self) -> int:
        return self.ids.shape[0]

    def __getitem__(self, j: int) -> dict[int, float]:
        return dict(zip(self.ids[j].tolist(), self.logprobs[j].tolist()))


@dataclass
class ScoreOutput:
    """One sequence's scores: `logprobs[i]` is log_softmax(logits / temperature) of token
    `start + i` given the tokens before it; `top` the alternatives there (score(top_logprobs=k)).
    A sequence the engine could not score (non-finite logits) has `error` and no logprobs."""

    token_ids: list[int]
    start: int
    logprobs: list[float] | None
    top: TopLogprobs | None = None
    error: str | None = None


@dataclass
class ScoreRows:
    """Rows of one or more sequences: logprob of each row's target, and its top-k."""

    logprobs: torch.Tensor  # float32 [R]
    top_ids: torch.Tensor  # int64 [R, k]
    top_logprobs: torch.Tensor  # float32 [R, k]

    @classmethod
    def empty(cls, rows: int, k: int) -> "ScoreRows":
        """Rows nobody asked for (below `start`): NaN, never returned."""
        return cls(torch.full((rows,), float("nan")), torch.zeros(rows, k, dtype=torch.long),
                   torch.full((rows, k), float("nan")))

    @classmethod
    def cat(cls, parts: list["ScoreRows"]) -> "ScoreRows":
        return cls(torch.cat([p.logprobs for p in parts]),
                   torch.cat([p.top_ids for p in parts]),
                   torch.cat([p.top_logprobs for p in parts]))

    def __getitem__(self, rows: slice) -> "ScoreRows":
        return ScoreRows(self.logprobs[rows], self.top_ids[rows], self.top_logprobs[rows])

    def __len__(self) -> int:
        return self.logprobs.shape[0]

    def to(self, device) -> "ScoreRows":
        return ScoreRows(self.logprobs.to(device), self.top_ids.to(device),
                         self.top_logprobs.to(device))


@dataclass(eq=False)
class ScoreState:
    targets: list[int]  # targets[p] = t_{p+1}: the token row p scores
    temperature: float
    top: int  # alternatives per row (0: none)
    prefix: ScoreRows  # rows 0 .. filled0 - 1, known when the sequence was queued
    parts: list[ScoreRows] = field(default_factory=list)  # rows computed since, in order

    @property
    def filled(self) -> int:
        """Rows known so far."""
        return len(self.prefix) + sum(map(len, self.parts))

    def add(self, rows: ScoreRows, journal: Journal) -> None:
        """The next rows, computed by a step (undone with the step's unit)."""
        self.parts.append(rows)
        journal.record(self.parts.pop)

    def rows(self) -> ScoreRows:
        return ScoreRows.cat([self.prefix, *self.parts])
