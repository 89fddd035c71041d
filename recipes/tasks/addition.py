"""The built-in task: 2-digit addition, "12+34=" -> "46", generated in code and scored by exact
match. Learnable by a 0.5M-parameter model in minutes on a CPU: what `make demo` and the
learning tests train on."""

from __future__ import annotations

import random

from datasets import Dataset

from .base import Task, check_rows

ALPHABET = "0123456789+="  # every character a prompt or an answer uses
MOST_ROWS = 100 * 100  # distinct prompts: the pairs of 0..99


def prompt(a: int, b: int) -> str:
    return f"{a}+{b}="


def addition(train_size: int, eval_size: int, seed: int) -> tuple[Dataset, Dataset]:
    """(train, held out): held-out pairs never appear in training."""
    pairs = [(a, b) for a in range(100) for b in range(100)]
    random.Random(seed).shuffle(pairs)
    check_rows("addition", train_size, eval_size, MOST_ROWS)

    def rows(chunk):
        return Dataset.from_dict({"prompt": [prompt(a, b) for a, b in chunk],
                                  "answer": [str(a + b) for a, b in chunk]})

    return rows(pairs[eval_size:eval_size + train_size]), rows(pairs[:eval_size])


def longest_turn(cfg) -> int:
    """Tokens of the longest answer, 99+99's, and EOS under the built-in tokenizer (one a
    character): the built-in model's max_new_tokens."""
    return len(str(99 + 99)) + 1


def longest_prompt(cfg) -> str:
    return prompt(99, 99)


def exact_reward(completion: str, answer: str) -> float:
    """1.0 when the completion, stripped of whitespace, equals the answer: the answers are bare
    numbers, so anything extra is wrong. A special token is extra too (the text a task scores
    keeps them), and so is a missing EOS: Task.score gives an exact-match completion that EOS
    did not end 0 (tasks/base.py)."""
    return float(completion.strip() == str(answer).strip())


def load(cfg, reward) -> Task:
    train, held_out = addition(cfg.train_size, cfg.eval_size, cfg.split_seed)
    return Task(train, held_out if cfg.eval_size else None, reward)
