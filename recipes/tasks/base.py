"""What a task gives a run: prompts and answers (two `datasets.Dataset`s with a `prompt` and an
`answer` column) and the reward that scores a completion against its answer.

A chat task's `prompt` is the conversation (a list of {"role", "content"} messages), not its
templated text: rollout/engine/chat.py, the one place that applies chat templates, renders it for the
engine (Task.encode: the ids `Engine.chat` gives), and TRL renders it as a conversational prompt
with the same template (`apply_chat_template(..., tokenize=True)`: the same ids). Templated text
would be encoded again by TRL with the tokenizer's special tokens added: a doubled BOS.

A multi-turn task also gives an environment (rollout.agent's protocol: `step(turn_ids, text)`,
one per episode), the stop strings that end a model turn (a tool call's closing tag), and the
warm start's demonstrations as (text, written by the model) segments; its reward then scores an
episode's whole text after the prompt (model and environment tokens, decoded)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from datasets import Dataset

from rollout.engine.chat import render_conversations


@dataclass
class Task:
    train: Dataset
    eval: Dataset | None
    reward: Callable[[str, str], float]
    alphabet: str | None = None  # characters of the built-in tokenizer; None for real models
    chat: bool = False  # prompts are conversations, rendered through the chat template
    environment: Callable[[], object] | None = None  # env factory: episodes instead of samples
    stop: Sequence[str] | None = None  # strings that end a model turn (e.g. a call's end tag)
    # (prompt, answer) -> [(text, written by the model)] after the prompt, for the warm start;
    # None: the answer alone.
    demonstration: Callable[[str, str], list[tuple[str, bool]]] | None = None

    def encode(self, tokenizer, prompts: list) -> list[list[int]]:
        """Prompt token ids, as the engine and the warm start both get them: conversations as
        rollout.chat renders them (the template writes its own special tokens, a Llama-3 BOS,
        say), plain text with the tokenizer's special tokens added."""
        if self.chat:
            return [ids for _, ids in render_conversations(tokenizer, prompts)]
        return [tokenizer.encode(p) for p in prompts]
