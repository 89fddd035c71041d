"""What a task gives a run: prompts and answers (two `datasets.Dataset`s with a `prompt` and an
`answer` column) and the reward that scores a completion against its answer.

A reward scores what the model wrote, token for token (`Task.score`, the one place every trainer
and the held-out accuracy score through): `reward(text, answer)`, the text decoded with its
special tokens (a stray <pad> or <bos> is there to see, where the engine's `Sample.text` skips
it) less the end-of-sequence token that closed it. A task that `needs_eos` (exact match) scores
0 where no such token did (a completion cut at max_tokens); math reads whatever was written.

A chat task's `prompt` is the conversation (a list of {"role", "content"} messages), not its
templated text: rollout/engine/chat.py, the one place that applies chat templates, renders it for the
engine (Task.encode: the ids `Engine.chat` gives), and TRL renders it as a conversational prompt
with the same template (`apply_chat_template(..., tokenize=True)`: the same ids). Templated text
would be encoded again by TRL with the tokenizer's special tokens added: a doubled BOS.

A multi-turn task also gives an environment (rollout.agent's protocol: `step(turn_ids, text)`,
one per episode), the stop strings that end a model turn (a tool call's closing tag), and the
warm start's demonstrations as (text, written by the model) segments; its reward then scores an
episode's whole text after the prompt (model and environment tokens, decoded alike)."""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from datasets import Dataset

from rollout.engine.chat import render_conversations


# (completion text, answer) -> score
Reward = Callable[[str, str], float]


def check_rows(task: str, train_size: int, eval_size: int, most: int) -> None:
    """A generated task draws each prompt once, training and held-out rows together."""
    if train_size + eval_size > most:
        raise ValueError(f"train_size + eval_size: {train_size} + {eval_size} is more than the "
                         f"{task} task's {most} distinct prompts")


def check_prompt_fits(prompt, tokens: int, max_new_tokens: int, max_model_len: int) -> None:
    """The longest prompt (`tokens` long) and max_new_tokens must fit in max_model_len: past it
    the engine caps a completion at max_model_len minus its prompt, and an answer cut before
    its EOS scores 0 under exact match."""
    if tokens + max_new_tokens > max_model_len:
        text = prompt[-1]["content"] if isinstance(prompt, list) else prompt  # a conversation
        raise ValueError(f"max_model_len: {max_model_len} is less than the longest prompt's "
                         f"{tokens} tokens + max_new_tokens {max_new_tokens} (the longest "
                         f"prompt: {text!r:.80}); raise max_model_len or lower max_new_tokens")


def completion_text(tokenizer, token_ids: Sequence[int],
                    eos_ids: Collection[int]) -> tuple[str, bool]:
    """(text, ended) of the tokens after a prompt, as a reward scores them: every token decoded,
    special ones included, but a final end-of-sequence token (one of `eos_ids`, the engine's),
    whose presence is `ended`."""
    ended = bool(token_ids) and token_ids[-1] in eos_ids
    body = list(token_ids[:-1] if ended else token_ids)
    return tokenizer.decode(body, skip_special_tokens=False), ended


@dataclass
class Task:
    train: Dataset
    eval: Dataset | None
    reward: Reward
    chat: bool = False  # prompts are conversations, rendered through the chat template
    environment: Callable[[], object] | None = None  # env factory: episodes instead of samples
    stop: Sequence[str] | None = None  # strings that end a model turn (e.g. a call's end tag)
    # (prompt, answer) -> [(text, written by the model)] after the prompt, for the warm start;
    # None: the answer alone.
    demonstration: Callable[[str, str], list[tuple[str, bool]]] | None = None
    needs_eos: bool = False  # a completion that no end-of-sequence token ended scores 0

    def encode(self, tokenizer, prompts: list) -> list[list[int]]:
        """Prompt token ids, as the engine and the warm start both get them: conversations as
        rollout.chat renders them (the template writes its own special tokens, a Llama-3 BOS,
        say), plain text with the tokenizer's special tokens added."""
        if self.chat:
            return [ids for _, ids in render_conversations(tokenizer, prompts)]
        return [tokenizer.encode(p) for p in prompts]

    def longest_prompt(self, tokenizer) -> tuple[object, int]:
        """(prompt, its tokens) of the longest prompt, training and held-out, as `encode`
        gives the engine its ids."""
        prompts = list(self.train["prompt"]) + (list(self.eval["prompt"]) if self.eval else [])
        lengths = [len(ids) for ids in self.encode(tokenizer, prompts)]
        longest = max(range(len(prompts)), key=lengths.__getitem__)
        return prompts[longest], lengths[longest]

    def score(self, tokenizer, token_ids: Sequence[int], answer: str,
              eos_ids: Collection[int]) -> float:
        """The reward of the tokens after a prompt: a sample's, or an episode's (model and
        environment tokens); `eos_ids`: the ids that end a sample (Engine.eos_ids)."""
        text, ended = completion_text(tokenizer, token_ids, eos_ids)
        return self.reward(text, answer) if ended or not self.needs_eos else 0.0
