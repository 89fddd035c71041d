"""What a task gives a run: prompts and answers (two `datasets.Dataset`s with a `prompt` and an
`answer` column) and the reward that scores a completion against its answer.

A multi-turn task also gives an environment (rollout.agent's protocol: `step(turn_ids, text)`,
one per episode), the stop strings that end a model turn (a tool call's closing tag), and the
warm start's demonstrations as (text, written by the model) segments; its reward then scores an
episode's whole text after the prompt (model and environment tokens, decoded)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from datasets import Dataset


@dataclass
class Task:
    train: Dataset
    eval: Dataset | None
    reward: Callable[[str, str], float]
    alphabet: str | None = None  # characters of the built-in tokenizer; None for real models
    templated: bool = False  # prompts went through the chat template (special tokens included)
    environment: Callable[[], object] | None = None  # env factory: episodes instead of samples
    stop: Sequence[str] | None = None  # strings that end a model turn (e.g. a call's end tag)
    # (prompt, answer) -> [(text, written by the model)] after the prompt, for the warm start;
    # None: the answer alone.
    demonstration: Callable[[str, str], list[tuple[str, bool]]] | None = None

    def encode(self, tokenizer, prompts: list[str]) -> list[list[int]]:
        """Prompt token ids, as the engine and the warm start both get them: a chat template
        already wrote the special tokens (a Llama-3 BOS, say), so they are not added twice."""
        return [tokenizer.encode(p, add_special_tokens=not self.templated) for p in prompts]
