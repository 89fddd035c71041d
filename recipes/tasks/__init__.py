"""Tasks: where prompts and answers come from and how a completion is scored. One file per
task, each with a `load(...) -> Task` (base.py):

    addition.py   the built-in task, generated in code: 2-digit sums, exact-match reward
    reverse.py    digit strings of 1-16 digits written back reversed: answers of every length
    gsm8k.py      a dataset (HF id, local dir or file) of GSM8K-style problems, math reward
    calculator.py 3-4 digit sums with a calculator tool: multi-turn episodes (an environment),
                  or single-turn without the tool (`tools: false`)

A new task is a new file here with its data, its reward (and, for multi-turn episodes, its
environment: see base.py), named in BUILTIN below and in TASKS of recipes/run/config.py; a
built-in one also gives its `longest_turn(cfg)`, the tokens of its longest model turn (the
built-in model's max_new_tokens), its `longest_prompt(cfg)` and MOST_ROWS, the distinct prompts
it can draw (both checked by RecipeConfig before anything loads).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from . import addition, calculator, gsm8k, reverse
from .addition import exact_reward
from .base import Reward, Task, check_prompt_fits
from .gsm8k import math_reward

if TYPE_CHECKING:  # the config resolves its defaults from the tasks
    from ..run.config import RecipeConfig

__all__ = ["NEEDS_EOS", "REWARDS", "Task", "builtin_alphabet", "exact_reward", "load_task",
           "math_reward"]

# Reward names a config may give (`reward: exact | math`; `auto` picks per task).
REWARDS: dict[str, Reward] = {"exact": exact_reward, "math": math_reward}
# Whether a reward scores only completions that EOS ended (Task.needs_eos): exact match takes
# nothing extra, a missing EOS included; math reads the answer wherever the completion stopped.
NEEDS_EOS = {"exact": True, "math": False}

# The built-in tasks (`task:` in a config, used when `dataset` is None) and their alphabets.
BUILTIN = {"addition": addition, "calculator": calculator, "reverse": reverse}


def load_task(cfg: RecipeConfig, tokenizer=None) -> Task:
    reward = REWARDS[cfg.reward_kind]
    if cfg.dataset is None:
        task = BUILTIN[cfg.task].load(cfg, reward)
    else:
        task = gsm8k.load(cfg, tokenizer, reward)
    if cfg.model is not None and tokenizer is not None:
        # A named model's tokens are known once its tokenizer loads (the built-in model's
        # prompts are checked by RecipeConfig, before anything loads).
        check_prompt_fits(*task.longest_prompt(tokenizer), cfg.max_new_tokens, cfg.max_model_len)
    return dataclasses.replace(task, needs_eos=NEEDS_EOS[cfg.reward_kind])


def builtin_alphabet(cfg: RecipeConfig) -> str | None:
    """Characters the built-in tokenizer needs; None when a real model brings its own."""
    return BUILTIN[cfg.task].ALPHABET if cfg.model is None else None
