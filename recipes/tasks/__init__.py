"""Tasks: where prompts and answers come from and how a completion is scored. One file per
task, each with a `load(...) -> Task` (base.py):

    addition.py   the built-in task, generated in code: 2-digit sums, exact-match reward
    reverse.py    digit strings of 1-16 digits written back reversed: answers of every length
    gsm8k.py      a dataset (HF id, local dir or file) of GSM8K-style problems, math reward
    calculator.py 3-4 digit sums with a calculator tool: multi-turn episodes (an environment),
                  or single-turn without the tool (`tools: false`)

A new task is a new file here with its data, its reward (and, for multi-turn episodes, its
environment: see base.py), named in BUILTIN below and in TASKS of recipes/run/config.py.
"""

from __future__ import annotations

from collections.abc import Callable

from ..run.config import RecipeConfig
from . import addition, calculator, gsm8k, reverse
from .addition import exact_reward
from .base import Task
from .gsm8k import math_reward

__all__ = ["REWARDS", "Task", "builtin_alphabet", "exact_reward", "load_task", "math_reward"]

# Reward names a config may give (`reward: exact | math`; `auto` picks per task).
REWARDS: dict[str, Callable[[str, str], float]] = {"exact": exact_reward, "math": math_reward}

# The built-in tasks (`task:` in a config, used when `dataset` is None) and their alphabets.
BUILTIN = {"addition": addition, "calculator": calculator, "reverse": reverse}


def load_task(cfg: RecipeConfig, tokenizer=None) -> Task:
    reward = REWARDS[cfg.reward_kind]
    if cfg.dataset is None:
        return BUILTIN[cfg.task].load(cfg, reward)
    return gsm8k.load(cfg, tokenizer, reward)


def builtin_alphabet(cfg: RecipeConfig) -> str | None:
    """Characters the built-in tokenizer needs; None when a real model brings its own."""
    return BUILTIN[cfg.task].ALPHABET if cfg.model is None else None
