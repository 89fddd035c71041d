"""`rollout.generate(model, prompts, params, **config)`: one call, one engine kept per model."""

from __future__ import annotations

import os
import weakref

from torch import nn

from .colocation.weights import weights_version
from .config import EngineConfig
from .engine.chat import is_conversations
from .engine.engine import Engine
from .models.checkpoint import checkpoint_tensors
from .models.loader import fit_max_model_len

# The engines `generate` keeps, so repeated calls reuse one (and its prefix cache). An in-memory
# model's entry [engine, weights version it holds] goes with the model (a weak key); a checkpoint
# path cannot be a weak key, so its engine stays until `drop_engines()`.
_ENGINES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_PATH_ENGINES: dict[str, Engine] = {}


def drop_engines() -> None:
    """Forget every engine `generate` keeps (their memory goes once nothing else holds them)."""
    _ENGINES.clear()
    _PATH_ENGINES.clear()


def generate(model, prompts, params=None, tokenizer=None, use_tqdm: bool = False,
             chat_template_kwargs: dict | None = None, **config):
    """Generate with an engine cached for `model` (rebuilt when `config` changes).

    `prompts` are strings, token-id lists, or chat conversations (lists of {"role", "content"}
    messages), which go through `Engine.chat`: the tokenizer's chat template with the
    generation prompt.

    The engine keeps its own copy of the weights and re-syncs it whenever the model's weights
    changed since the previous call. Call `engine_for(model).sleep()` to free its memory
    before an optimizer step (trainer_hooks.ColocatedRollout does all of this per step).
    """
    chat = is_conversations(prompts)
    if chat_template_kwargs is not None and not chat:
        raise ValueError("chat_template_kwargs: prompts are not chat conversations")
    engine = engine_for(model, tokenizer=tokenizer, **config)
    if chat:
        return engine.chat(prompts, params, use_tqdm, chat_template_kwargs)
    return engine.generate(prompts, params, use_tqdm=use_tqdm)


def engine_for(model, tokenizer=None, **config) -> Engine:
    """The engine cached for `model` (an in-memory model, a checkpoint folder or a hub id),
    awake and holding the model's current weights (synced in place when they changed since the
    last call, e.g. after an optimizer step)."""
    cfg = EngineConfig(**config)
    if isinstance(model, (str, os.PathLike)):
        return _checkpoint_engine(_checkpoint_key(os.fspath(model)), cfg, tokenizer)
    if not isinstance(model, nn.Module):
        # None, a number, a dict: Engine's own check refuses it with its ValueError naming
        # `model`, which the weak-key lookup below would pre-empt with a TypeError.
        return Engine(model, cfg, tokenizer=tokenizer)
    entry = _ENGINES.get(model)
    if entry is None or not _reusable(entry[0], cfg, tokenizer):
        entry = [Engine(model, cfg, tokenizer=tokenizer), weights_version(model)]
        _ENGINES[model] = entry
    engine = entry[0]
    engine.wake_up()
    if weights_version(model) != entry[1] or engine.needs_weights:
        engine.update_weights(model)
        # Read after the sync: PEFT's merge/unmerge fallback (DoRA) writes the base weights
        # while they are read, which must not count as a change next time.
        entry[1] = weights_version(model)
    return engine


def _checkpoint_key(model: str) -> str:
    """One name per checkpoint: a folder's real path (`~` expanded, links followed), so its
    spellings share an engine; anything else as given (a hub id, or a missing folder, which
    Engine refuses naming what was asked for), not made a folder under the working one."""
    folder = os.path.expanduser(model)
    return os.path.realpath(folder) if os.path.isdir(folder) else model


def _checkpoint_engine(path: str, cfg: EngineConfig, tokenizer) -> Engine:
    """A checkpoint's weights are read again only when sleep(level=2) dropped them."""
    engine = _PATH_ENGINES.get(path)
    if engine is None or not _reusable(engine, cfg, tokenizer):
        engine = _PATH_ENGINES[path] = Engine(path, cfg, tokenizer=tokenizer)
    engine.wake_up()
    if engine.needs_weights:
        engine.update_weights(checkpoint_tensors(path))
    return engine


def _reusable(engine: Engine, cfg: EngineConfig, tokenizer) -> bool:
    # the engine holds its config fitted to the model (max_model_len None made a number)
    return engine.config == fit_max_model_len(cfg, engine.hf_config) and (
        tokenizer is None or engine.tokenizer is tokenizer)
