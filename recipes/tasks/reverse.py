"""A built-in task whose answers vary widely in length: a digit string of 1-16 digits, written
back reversed, "3141=" -> "1413", scored by exact match. An answer is as long as its prompt, so a
step's samples end after 2 to 17 tokens (EOS included) and more when a sample misses EOS: the
tail that partial rollouts cut (tests/integrations/test_learning.py compares them with
synchronous rollouts on it). The addition task's answers are all 2-3 tokens long."""

from __future__ import annotations

import random

from datasets import Dataset

from .base import Task, check_rows

ALPHABET = "0123456789="
LONGEST = 16  # digits of the longest prompt (and answer)
MOST_ROWS = sum(10 ** digits for digits in range(1, LONGEST + 1))  # distinct digit strings


def prompt(digits: str) -> str:
    return f"{digits}="


def strings(train_size: int, eval_size: int, seed: int) -> tuple[Dataset, Dataset]:
    """(train, held out): lengths drawn uniformly in 1..LONGEST, each string once, so held-out
    strings never appear in training (there are only 10 one-digit strings and 100 two-digit
    ones: the shortest lengths are rarer than the rest)."""
    check_rows("reverse", train_size, eval_size, MOST_ROWS)
    rng = random.Random(seed)
    seen: set[str] = set()
    while len(seen) < train_size + eval_size:
        length = rng.randint(1, LONGEST)
        seen.add("".join(rng.choice("0123456789") for _ in range(length)))
    ordered = sorted(seen)
    rng.shuffle(ordered)

    def rows(chunk):
        return Dataset.from_dict({"prompt": [prompt(s) for s in chunk],
                                  "answer": [s[::-1] for s in chunk]})

    return rows(ordered[eval_size:]), rows(ordered[:eval_size])


def longest_turn(cfg) -> int:
    """Tokens of the longest answer, LONGEST digits, and EOS under the built-in tokenizer (one
    a character): the built-in model's max_new_tokens."""
    return LONGEST + 1


def longest_prompt(cfg) -> str:
    return prompt("9" * LONGEST)


def load(cfg, reward) -> Task:
    train, held_out = strings(cfg.train_size, cfg.eval_size, cfg.split_seed)
    return Task(train, held_out if cfg.eval_size else None, reward)
