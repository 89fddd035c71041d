"""`rollout.generate(model, prompts, params, **config)`: one call, one engine kept per model."""

from __future__ import annotations

import weakref

from .config import EngineConfig
from .engine import Engine
from .weights import weights_version

# model object -> (config it was built with, engine); dropped with the model.
_ENGINES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def generate(model, prompts, params=None, tokenizer=None, use_tqdm: bool = False, **config):
    """Generate with an engine cached for `model` (rebuilt when `config` changes).

    The engine keeps its own copy of the weights and re-syncs it whenever the model's weights
    changed since the previous call. Call `engine_for(model).sleep()` to free its memory
    before an optimizer step (trainer_hooks.ColocatedRollout does all of this per step).
    """
    return engine_for(model, tokenizer=tokenizer, **config).generate(prompts, params,
                                                                     use_tqdm=use_tqdm)


def engine_for(model, tokenizer=None, **config) -> Engine:
    """The engine cached for `model`, awake and holding the model's current weights (synced
    in place when they changed since the last call, e.g. after an optimizer step)."""
    cfg = EngineConfig(**config)
    entry = _ENGINES.get(model)
    if entry is None or entry[0] != cfg or (tokenizer is not None and entry[1].tokenizer
                                             is not tokenizer):
        entry = [cfg, Engine(model, cfg, tokenizer=tokenizer), weights_version(model)]
        _ENGINES[model] = entry
    engine = entry[1]
    engine.wake_up()
    version = weights_version(model)
    if version != entry[2] or engine.needs_weights:
        engine.update_weights(model)
        entry[2] = version
    return engine
