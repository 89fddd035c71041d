"""Verifiable rewards: 1.0 for a correct answer, 0.0 otherwise.

`exact`: the completion, stripped, equals the answer (the built-in task's answers are bare
numbers, so anything extra is wrong). `math`: the last number in the completion equals the
gold answer's number, where a GSM8K-style gold answer gives it after `####`.
"""

from __future__ import annotations

import re
from collections.abc import Callable

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def exact_reward(completion: str, answer: str) -> float:
    return float(completion.strip() == str(answer).strip())


def final_number(text: str) -> float | None:
    """The last number in `text` (thousands separators allowed), or None."""
    found = _NUMBER.findall(text)
    if not found:
        return None
    try:
        return float(found[-1].replace(",", ""))
    except ValueError:
        return None


def gold_number(answer: str) -> float | None:
    answer = str(answer)
    if "####" in answer:
        answer = answer.rsplit("####", 1)[1]
    return final_number(answer)


def math_reward(completion: str, answer: str) -> float:
    # A model that keeps writing after `####` still names its answer right after it.
    if "####" in completion:
        tail = completion.rsplit("####", 1)[1]
        got = final_number(tail.strip().split("\n", 1)[0]) if tail.strip() else None
    else:
        got = final_number(completion)
    gold = gold_number(answer)
    return float(got is not None and gold is not None and abs(got - gold) < 1e-6)


REWARDS: dict[str, Callable[[str, str], float]] = {"exact": exact_reward, "math": math_reward}
