"""Multi-digit addition with a calculator tool: a task the tiny model cannot do alone.

    prompt      "1234+567="
    model       "<c>1234+567</c>"      a tool call; the stop string "</c>" ends the turn
    environment "<r>1801</r>"          the calculator's answer (env tokens: mask 0)
    model       "1801" EOS             the answer; a turn without a call ends the episode

Operands have 3 or 4 digits (100..9999). The reward is exact match of what the model wrote after
the last tool result (its whole completion when it made no call), so the same reward scores a
multi-turn episode with the tool and a single-turn completion without it (`tools: false`, the
baseline: the model must add by itself). The environment only runs the tool; it gives no
reward.

A supervised warm start on demonstrations (`demonstration`: the call, the result as
environment text that is not trained on, the answer) teaches the protocol; GRPO does the rest.
"""

from __future__ import annotations

import random
import re

from datasets import Dataset

from rollout.agent import Step

from .addition import prompt  # the same sums, larger operands
from .base import Task, check_rows

ALPHABET = "0123456789+=<>/cr"  # digits, the sum, and the tags <c> </c> <r> </r>
CALL, END_CALL, RESULT, END_RESULT = "<c>", "</c>", "<r>", "</r>"
LOW, HIGH = 100, 9999  # operands: 3 or 4 digits
# Distinct prompts drawn at most: half the operand pairs, so that drawing them by rejection
# stays quick.
MOST_ROWS = (HIGH - LOW + 1) ** 2 // 2
_SUM = re.compile(r"(\d{1,9})\+(\d{1,9})")


def sums(train_size: int, eval_size: int, seed: int) -> tuple[Dataset, Dataset]:
    """(train, held out) of distinct operand pairs: held-out pairs never appear in training."""
    check_rows("calculator", train_size, eval_size, MOST_ROWS)
    rng = random.Random(seed)
    seen: set[tuple[int, int]] = set()
    pairs: list[tuple[int, int]] = []
    while len(pairs) < train_size + eval_size:
        pair = (rng.randint(LOW, HIGH), rng.randint(LOW, HIGH))
        if pair not in seen:
            seen.add(pair)
            pairs.append(pair)

    def rows(chunk):
        return Dataset.from_dict({"prompt": [prompt(a, b) for a, b in chunk],
                                  "answer": [str(a + b) for a, b in chunk]})

    return rows(pairs[eval_size:]), rows(pairs[:eval_size])


class Calculator:
    """The environment of one episode. A turn that opens a call ("<c>") gets the value of the
    call's sum ("<r>1801</r>"; "<r></r>" when the call is not `digits+digits`); any other turn
    is the answer and ends the episode."""

    def step(self, turn_ids, text):
        text = text or ""  # the engine leaves the stop string "</c>" out of a turn's text
        if CALL not in text:
            return Step(done=True)
        expression = text.rsplit(CALL, 1)[1].split(END_CALL, 1)[0]
        match = _SUM.fullmatch(expression)
        value = str(int(match[1]) + int(match[2])) if match else ""
        return Step(observation=f"{RESULT}{value}{END_RESULT}")


def final_answer(completion: str) -> str:
    """What the model wrote after the last tool result (the whole completion without one)."""
    return completion.rsplit(END_RESULT, 1)[-1]


def demonstration(prompt: str, answer: str, tools: bool) -> list[tuple[str, bool]]:
    """The warm start's target after the prompt, as (text, written by the model) segments: the
    environment's result is context, not trained on. EOS follows (the model's)."""
    if not tools:
        return [(answer, True)]
    expression = prompt.rstrip("=")
    return [(f"{CALL}{expression}{END_CALL}", True), (f"{RESULT}{answer}{END_RESULT}", False),
            (answer, True)]


def longest_turn(cfg) -> int:
    """Tokens of the longest model turn under the built-in tokenizer (one a character): the
    call on the largest operands (its closing tag ends the turn), or without the tool the
    largest sum and EOS. The built-in model's max_new_tokens."""
    if cfg.tools:
        return len(f"{CALL}{HIGH}+{HIGH}{END_CALL}")
    return len(str(HIGH + HIGH)) + 1


def longest_prompt(cfg) -> str:
    return prompt(HIGH, HIGH)


def load(cfg, reward) -> Task:
    train, held_out = sums(cfg.train_size, cfg.eval_size, cfg.split_seed)

    def scored(completion: str, answer: str) -> float:
        return reward(final_answer(completion), answer)

    tools = cfg.tools
    return Task(train, held_out if cfg.eval_size else None, scored,
                environment=Calculator if tools else None,
                stop=[END_CALL] if tools else None,
                demonstration=lambda p, a: demonstration(p, a, tools))
