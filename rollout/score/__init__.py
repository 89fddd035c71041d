"""Scoring: the logprob of every token of given sequences (Engine.score, docs/logprobs.md)."""

from .state import ScoreOutput, TopLogprobs

__all__ = ["ScoreOutput", "TopLogprobs"]
