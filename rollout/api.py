"""`rollout.generate(model, prompts, params, **config)`: one call, one engine kept per model."""

from __future__ import annotations

import weakref

from .config import EngineConfig
from .engine import Engine

# model object -> (config it was built with, engine); dropped with the model.
_ENGINES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def generate(model, prompts, params=None, tokenizer=None, use_tqdm: bool = False, **config):
    """Generate with an engine cached for `model` (rebuilt when `config` changes).

    The cached engine holds its own copy of the weights, taken when it was built: after an
    optimizer step call `engine_for(model).update_weights(model)`, or use
    trainer_hooks.ColocatedRollout, which syncs only when the weights changed.
    """
    return engine_for(model, tokenizer=tokenizer, **config).generate(prompts, params,
                                                                     use_tqdm=use_tqdm)


def engine_for(model, tokenizer=None, **config) -> Engine:
    cfg = EngineConfig(**config)
    entry = _ENGINES.get(model)
    if entry is None or entry[0] != cfg or (tokenizer is not None and entry[1].tokenizer
                                             is not tokenizer):
        entry = (cfg, Engine(model, cfg, tokenizer=tokenizer))
        _ENGINES[model] = entry
    return entry[1]
