"""What a task gives a run: prompts and answers (two `datasets.Dataset`s with a `prompt` and an
`answer` column) and the reward that scores a completion against its answer."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from datasets import Dataset


@dataclass
class Task:
    train: Dataset
    eval: Dataset | None
    reward: Callable[[str, str], float]
    alphabet: str | None = None  # characters of the built-in tokenizer; None for real models
    templated: bool = False  # prompts went through the chat template (special tokens included)

    def encode(self, tokenizer, prompts: list[str]) -> list[list[int]]:
        """Prompt token ids, as the engine and the warm start both get them: a chat template
        already wrote the special tokens (a Llama-3 BOS, say), so they are not added twice."""
        return [tokenizer.encode(p, add_special_tokens=not self.templated) for p in prompts]
