"""Requests in: prompts and params checked completely, changing nothing, before any is queued.

A bad request raises ValueError naming the field and its limit; the engine keeps serving the
others. A checked request becomes a `Request` (request.py): one prompt's n sequences.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence as Seq

import numpy as np
import torch

from ..fields import as_int, show
from ..sample.params import SamplingParams

Prompt = str | Seq[int]


def hold_key(key, field: str = "resume") -> tuple[str, int]:
    """A multi-turn hold's key as add_request(resume=) and release_hold take it: (request id,
    sample index); `field` names the argument in a refusal. A well-formed key whose hold is
    gone (released, or dropped under memory pressure) is accepted: the turn then recomputes
    what the hold kept."""
    if (isinstance(key, (str, bytes)) or not isinstance(key, (tuple, list)) or len(key) != 2
            or not isinstance(key[0], str)):
        raise ValueError(f"{field} must be a (request_id, sample_index) pair, got {show(key)}")
    return key[0], as_int(f"{field}: sample_index", key[1], 0)


def check_requests(prompts, params) -> list[tuple[Prompt, SamplingParams | None]]:
    """generate()'s arguments as (prompt, params) pairs."""
    if isinstance(prompts, str) or not isinstance(prompts, (list, tuple)):
        raise ValueError("prompts must be a list of strings or of token-id lists")
    if params is None or isinstance(params, SamplingParams):
        return [(p, params) for p in prompts]
    if not isinstance(params, (list, tuple)):
        raise ValueError(f"params must be a SamplingParams or a list of them (one per prompt), "
                         f"got {type(params).__name__}")
    if len(params) != len(prompts):
        raise ValueError(f"params: {len(params)} SamplingParams for {len(prompts)} prompts")
    return list(zip(prompts, params))


def check_request(prompt: Prompt, params: SamplingParams | None, vocab_size: int,
                  max_model_len: int, tokenizer) -> tuple[str | None, list[int], SamplingParams]:
    """A request's text, token ids and the engine's own validated copy of its params."""
    params = SamplingParams() if params is None else params
    if not isinstance(params, SamplingParams):
        raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
    # A copy built through __init__ re-runs validation on the fields as they are now (they
    # may have been set after construction) and keeps later edits of the caller's object,
    # often reused for the next batch, away from this request.
    params = dataclasses.replace(params)
    params.resolve(vocab_size)
    if params.stop and tokenizer is None:
        raise ValueError("stop: stop strings need a tokenizer; pass tokenizer= to Engine")
    text, ids = prompt_ids(prompt, vocab_size, max_model_len, tokenizer)
    return text, ids, params


def prompt_ids(prompt: Prompt, vocab_size: int, max_model_len: int, tokenizer
               ) -> tuple[str | None, list[int]]:
    return token_ids("prompt", prompt, vocab_size, tokenizer, max_model_len - 1,
                     f"max_model_len - 1 = {max_model_len - 1} (room for one generated token)")


def prefix_ids(name: str, value: Prompt, vocab_size: int, tokenizer, max_len: int) -> list[int]:
    """token_ids' ids of the first `max_len` tokens (no sequence, so no cached prefix, is longer:
    the rest is not read, however long), where empty is an empty prefix."""
    if isinstance(value, str) and not value:
        return []  # no tokens asked about (encoding it could give a BOS)
    if isinstance(value, (list, tuple)) or (isinstance(value, (torch.Tensor, np.ndarray))
                                            and value.ndim == 1):  # (token_ids refuses others)
        value = value[:max_len]
    return token_ids(name, value, vocab_size, tokenizer, empty_ok=True)[1][:max_len]


def token_ids(name: str, value: Prompt, vocab_size: int, tokenizer, max_len: int | None = None,
              limit: str = "", empty_ok: bool = False) -> tuple[str | None, list[int]]:
    """A string (tokenized) or a list of token ids (a 1-D tensor or array too) as (text, ids),
    refused when empty (unless `empty_ok`), longer than `max_len` (`limit` says which limit
    that is) or when an id is not an int of the vocabulary; `name` is the field in the
    message. The length is checked before any id is converted: a prompt of millions of tokens
    is refused at once, not after a Python int and a check of each."""
    text = None
    if isinstance(value, str):
        if tokenizer is None:
            raise ValueError(f"{name}: a string needs a tokenizer; pass tokenizer= to Engine "
                             f"or give token ids")
        text, value = value, tokenizer.encode(value)
    if isinstance(value, (torch.Tensor, np.ndarray)) and value.ndim != 1:
        raise ValueError(f"{name} must be 1-D token ids, got shape {tuple(value.shape)}")
    if not isinstance(value, (list, tuple, torch.Tensor, np.ndarray)):
        raise ValueError(f"{name} must be a string or a list of token ids, "
                         f"got {type(value).__name__}")
    if len(value) == 0:
        if empty_ok:
            return text, []
        raise ValueError(f"{name}: empty; it needs at least 1 token")
    if max_len is not None and len(value) > max_len:
        raise ValueError(f"{name}: {len(value)} tokens, more than {limit}")
    if isinstance(value, torch.Tensor) and value.is_meta:
        raise ValueError(f"{name}: a meta tensor holds no token ids")
    if isinstance(value, (torch.Tensor, np.ndarray)):
        value = value.tolist()
    ids = [as_int(f"{name}: token id", t) for t in value]
    for t in ids:
        if not 0 <= t < vocab_size:
            raise ValueError(f"{name}: token id {t!r} is outside the vocabulary "
                             f"[0, {vocab_size})")
    return text, ids
