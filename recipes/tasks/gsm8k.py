"""Math word problems from a dataset, GSM8K-style: an HF hub id (`--dataset openai/gsm8k
--dataset_config main`), a local dataset directory, or one .json/.jsonl/.csv/.parquet file.
Prompts come from `prompt_template` over each row (unset: the row's `prompt` column, else its
`question`, GSM8K's): with the tokenizer's chat template (if any),
a conversation (`system_prompt`, then that text as the user's message) that rollout/engine/chat.py
renders (tasks/base.py); otherwise plain text, after `system_prompt` if one is given. The reward
is `math` unless the config names another: the completion's answer (the first number after its
last `####`, else its last number) against the gold answer's, which GSM8K gives after `####`.
"""

from __future__ import annotations

import contextlib
import re
from typing import TYPE_CHECKING

from datasets import Dataset

from rollout.engine.chat import render_conversations

from ..run.data_files import data_file_type, is_data_file
from .base import Task

if TYPE_CHECKING:  # the config resolves its defaults from the tasks
    from ..run.config import RecipeConfig

# Thousands separators allowed; a number may begin at its point (".5", "-.25"), not after
# another point ("...10" is 10).
_NUMBER = re.compile(r"-?(?:\d[\d,]*(?:\.\d+)?|(?<![\d.])\.\d+)")


def _number(text: str, which: int) -> float | None:
    """The first (which=0) or last (-1) number in `text`, or None."""
    found = _NUMBER.findall(text)
    if not found:
        return None
    try:
        return float(found[which].replace(",", ""))
    except ValueError:
        return None


def final_number(text: str) -> float | None:
    """The last number in `text`, or None."""
    return _number(text, -1)


def answer_number(text: str) -> float | None:
    """The number a text names as its answer: the first one after its last `####`, on the
    line it opens (a model that keeps writing after it, "#### 42 (6 x 7)", still named 42
    first; so does a GSM8K gold answer), else the text's last number."""
    if "####" not in text:
        return final_number(text)
    tail = text.rsplit("####", 1)[1].strip()
    return _number(tail.split("\n", 1)[0], 0) if tail else None


def gold_number(answer: str) -> float | None:
    return answer_number(str(answer))


def math_reward(completion: str, answer: str) -> float:
    """The completion's answer number against the gold answer's. Lenient by design about what
    exact match refuses: a completion cut at max_tokens after its answer line still named it
    (the task does not ask for EOS: Task.needs_eos). The special tokens its text keeps are read
    as text: one with digits in its name (which a model seldom writes) could be read as one."""
    got, gold = answer_number(completion), gold_number(answer)
    return float(got is not None and gold is not None and abs(got - gold) < 1e-6)


def load(cfg: RecipeConfig, tokenizer, reward) -> Task:
    with _datasets_bars_off() if not cfg.progress else contextlib.nullcontext():
        return _load(cfg, tokenizer, reward)


@contextlib.contextmanager
def _datasets_bars_off():
    """`datasets`' own bars (a split generated, the prompts mapped) off, as `progress: false`
    asks; a process-wide setting, so turned back on after unless they were off already (e.g.
    by $HF_DATASETS_DISABLE_PROGRESS_BARS)."""
    from datasets.utils import (are_progress_bars_disabled, disable_progress_bars,
                                enable_progress_bars)

    if are_progress_bars_disabled():
        yield
        return
    disable_progress_bars()
    try:
        yield
    finally:
        enable_progress_bars()


def _load(cfg: RecipeConfig, tokenizer, reward) -> Task:
    if is_data_file(cfg.dataset):
        # One local file: its last eval_size rows (after a seeded shuffle) are held out.
        rows = _load_split(cfg, "train").shuffle(seed=cfg.split_seed)
        held = min(cfg.eval_size, len(rows) // 2)
        if cfg.eval_size and not held:
            raise _no_held_out(cfg)
        train = rows.select(range(len(rows) - held))
        held_out = rows.select(range(len(rows) - held, len(rows))) if held else None
    else:
        train = _load_split(cfg, cfg.train_split)
        held_out = _load_split(cfg, cfg.eval_split) if cfg.eval_size else None
        if held_out is not None and not len(held_out):
            raise _no_held_out(cfg)
        if held_out is not None and len(held_out) > cfg.eval_size:
            held_out = held_out.shuffle(seed=cfg.split_seed).select(range(cfg.eval_size))
    chat = _uses_chat_template(cfg, tokenizer)
    fmt = _formatter(cfg, tokenizer, chat, _template(cfg, train.column_names))
    train = train.map(fmt, desc="prompts")
    held_out = held_out.map(fmt, desc="prompts") if held_out is not None else None
    return Task(train, held_out, reward, chat=chat)


def _no_held_out(cfg: RecipeConfig) -> ValueError:
    # An accuracy over no prompts is 0/0: refused rather than reported as nan%.
    return ValueError(f"eval_size: {cfg.eval_size} asked, but {cfg.dataset!r} leaves the "
                      f"held-out set empty (a single file holds out at most half of its rows, "
                      f"a dataset its eval_split {cfg.eval_split!r}); set eval_size 0 to skip "
                      f"the evaluation")


def _load_split(cfg: RecipeConfig, split: str) -> Dataset:
    from datasets import load_dataset

    name = cfg.dataset
    kind = data_file_type(name)
    if kind is not None:  # a local file loads as a single split
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


# The columns an unset prompt_template takes the prompt from, the first one present.
_PROMPT_COLUMNS = ("prompt", "question")


def _template(cfg: RecipeConfig, columns: list[str]) -> str:
    if cfg.prompt_template is not None:
        return cfg.prompt_template
    for column in _PROMPT_COLUMNS:
        if column in columns:
            return f"{{{column}}}"
    raise ValueError(f"prompt_template: unset, and the dataset has no "
                     f"{' or '.join(map(repr, _PROMPT_COLUMNS))} column to take prompts from "
                     f"(columns: {columns}); set one, e.g. '{{{columns[0]}}}'")


def _formatter(cfg: RecipeConfig, tokenizer, use_chat: bool, template: str):
    """Row -> {prompt, answer}: the template over the row, as a conversation when the chat
    template is used, else as text."""

    def fmt(row: dict) -> dict:
        try:
            text = template.format(**row)
        except KeyError as e:
            raise ValueError(f"prompt_template: field {e.args[0]!r} is not a column "
                             f"(columns: {sorted(row)})") from None
        if use_chat:
            prompt = [{"role": "user", "content": text}]
            if cfg.system_prompt:
                prompt.insert(0, {"role": "system", "content": cfg.system_prompt})
            _check_renders(tokenizer, prompt)
        else:
            prompt = f"{cfg.system_prompt}\n{text}" if cfg.system_prompt else text
        return {"prompt": prompt, "answer": str(row[cfg.answer_field])}

    return fmt


def _check_renders(tokenizer, conversation: list[dict]) -> None:
    # Rendered (and dropped) at load only so that a template that fails, e.g. one refusing a
    # system message, fails here naming the config's field, not mid-run in Task.encode.
    try:
        render_conversations(tokenizer, [conversation])
    except ValueError as e:
        raise ValueError(f"chat_template: the tokenizer's chat template fails on the prompt "
                         f"{conversation[-1]['content']!r:.80} ({e}); fix the template, or set "
                         f"chat_template: false for plain-text prompts") from e
