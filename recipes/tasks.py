"""Where prompts and answers come from: the built-in task generated in code, or a dataset.

A Task is two `datasets.Dataset`s with a `prompt` (text given to the model) and an `answer`
column, plus the reward that scores a completion against its answer.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from dataclasses import dataclass

from datasets import Dataset

from .config import DATA_FILE_TYPES, RecipeConfig, is_data_file
from .rewards import REWARDS

ADDITION_ALPHABET = "0123456789+="


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


def addition(train_size: int, eval_size: int, seed: int) -> tuple[Dataset, Dataset]:
    """2-digit addition, "12+34=" -> "46": learnable by a 0.5M-parameter model in minutes,
    and checkable exactly. Held-out pairs never appear in training."""
    pairs = [(a, b) for a in range(100) for b in range(100)]
    random.Random(seed).shuffle(pairs)
    if eval_size + train_size > len(pairs):
        raise ValueError(f"train_size + eval_size must be <= {len(pairs)} for the addition "
                         f"task, got {train_size} + {eval_size}")

    def rows(chunk):
        return Dataset.from_dict({"prompt": [f"{a}+{b}=" for a, b in chunk],
                                  "answer": [str(a + b) for a, b in chunk]})

    return rows(pairs[eval_size:eval_size + train_size]), rows(pairs[:eval_size])


def load_task(cfg: RecipeConfig, tokenizer=None) -> Task:
    reward = REWARDS[cfg.reward_kind]
    if cfg.dataset is None:
        train, held_out = addition(cfg.train_size, cfg.eval_size, cfg.seed)
        return Task(train, held_out if cfg.eval_size else None, reward, ADDITION_ALPHABET)
    if is_data_file(cfg.dataset):
        # One local file: its last eval_size rows (after a seeded shuffle) are held out.
        rows = _load_split(cfg, "train").shuffle(seed=cfg.seed)
        cut = len(rows) - min(cfg.eval_size, len(rows) // 2)
        train = rows.select(range(cut))
        held_out = rows.select(range(cut, len(rows))) if cfg.eval_size else None
    else:
        train = _load_split(cfg, cfg.train_split)
        held_out = _load_split(cfg, cfg.eval_split) if cfg.eval_size else None
        if held_out is not None and len(held_out) > cfg.eval_size:
            held_out = held_out.shuffle(seed=cfg.seed).select(range(cfg.eval_size))
    templated = _uses_chat_template(cfg, tokenizer)
    fmt = _formatter(cfg, tokenizer, templated)
    train = train.map(fmt, desc="prompts")
    held_out = held_out.map(fmt, desc="prompts") if held_out is not None else None
    return Task(train, held_out, reward, templated=templated)


def _load_split(cfg: RecipeConfig, split: str) -> Dataset:
    from datasets import load_dataset

    name = cfg.dataset
    if is_data_file(name):  # a local file loads as a single split
        kind = DATA_FILE_TYPES[os.path.splitext(name)[1].lstrip(".")]
        ds = load_dataset(kind, data_files={split: name}, split=split)
    else:
        ds = load_dataset(name, cfg.dataset_config, split=split)
    missing = [c for c in [cfg.answer_field] if c not in ds.column_names]
    if missing:
        raise ValueError(f"answer_field: column {missing[0]!r} not in {name!r} "
                         f"(columns: {ds.column_names})")
    return ds


def _uses_chat_template(cfg: RecipeConfig, tokenizer) -> bool:
    if cfg.chat_template is None:
        return getattr(tokenizer, "chat_template", None) is not None
    return cfg.chat_template


def _formatter(cfg: RecipeConfig, tokenizer, use_chat: bool):
    """Row -> {prompt, answer}: the template over the row, then the chat template if any."""

    def fmt(row: dict) -> dict:
        try:
            text = cfg.prompt_template.format(**row)
        except KeyError as e:
            raise ValueError(f"prompt_template: field {e.args[0]!r} is not a column "
                             f"(columns: {sorted(row)})") from None
        if use_chat:
            messages = [{"role": "user", "content": text}]
            if cfg.system_prompt:
                messages.insert(0, {"role": "system", "content": cfg.system_prompt})
            text = tokenizer.apply_chat_template(messages, tokenize=False,
                                                 add_generation_prompt=True)
        elif cfg.system_prompt:
            text = f"{cfg.system_prompt}\n{text}"
        return {"prompt": text, "answer": str(row[cfg.answer_field])}

    return fmt


def builtin_alphabet(cfg: RecipeConfig) -> str | None:
    """Characters the built-in tokenizer needs; None when a real model brings its own."""
    return {"addition": ADDITION_ALPHABET}[cfg.task] if cfg.model is None else None
