"""The library configs that a recipe's keys become: `speculative`
(rollout.spec.SpeculativeConfig), `lora` (peft.LoraConfig) and the engine's (rollout.EngineConfig),
each raising ValueError naming the bad recipe key before any model is built."""

from __future__ import annotations

import dataclasses
import math
import re
import typing


def lora_config(cfg):
    """The peft.LoraConfig of `cfg.lora` (None without one); ValueError naming a bad key."""
    if cfg.lora is None:
        return None
    import peft

    known = {f.name for f in dataclasses.fields(peft.LoraConfig)}
    unknown = sorted(set(cfg.lora) - known, key=str)  # YAML may give a non-string key
    if unknown:
        raise ValueError(f"lora: unknown key(s) {unknown}; see peft.LoraConfig")
    options = {"task_type": "CAUSAL_LM", "lora_dropout": 0.0, **cfg.lora}
    # PEFT takes these unchecked and fails later, inside the model.
    r, alpha, dropout = options.get("r", 8), options.get("lora_alpha", 8), options["lora_dropout"]
    if not _is_number(r, int) or r < 1:
        raise ValueError(f"lora.r must be an int >= 1, got {r!r}")
    if not _is_number(alpha, (int, float)) or not 0 < alpha < math.inf:
        raise ValueError(f"lora.lora_alpha must be a number > 0 and finite, got {alpha!r}")
    if not _is_number(dropout, (int, float)) or not 0 <= dropout < 1:
        raise ValueError(f"lora.lora_dropout must be a number in [0, 1), got {dropout!r}")
    # PEFT takes any string for these and fails in get_peft_model, or wraps the policy as
    # another task's model (a sequence classifier) without a word.
    biases = typing.get_args(typing.get_type_hints(peft.LoraConfig)["bias"])
    if options.get("bias", "none") not in biases:
        raise ValueError(f"lora.bias must be one of {biases}, got {options['bias']!r}")
    if options["task_type"] != "CAUSAL_LM":  # peft.TaskType.CAUSAL_LM, a str enum, equals it
        raise ValueError(f"lora.task_type must be CAUSAL_LM (the recipes train causal LMs), "
                         f"got {options['task_type']!r}")
    targets = options.get("target_modules")
    if not (targets is None or isinstance(targets, str) or isinstance(targets, (list, tuple))
            and targets and all(isinstance(t, str) for t in targets)):
        raise ValueError(f"lora.target_modules must be a module name or pattern (e.g. "
                         f"all-linear), a non-empty list of them, or null (PEFT's choice for "
                         f"the architecture), got {targets!r}")
    try:
        return peft.LoraConfig(**options)
    except (TypeError, ValueError) as e:
        raise ValueError(f"lora: {e}") from None


def _is_number(value, types) -> bool:
    return isinstance(value, types) and not isinstance(value, bool)  # True is an int to Python


def speculative_config(cfg):
    if cfg.speculative is None:
        return None
    from rollout.spec import SpeculativeConfig

    known = {f.name for f in dataclasses.fields(SpeculativeConfig)}
    unknown = sorted(set(cfg.speculative) - known, key=str)  # likewise
    if unknown:
        raise ValueError(f"speculative: unknown key(s) {unknown}; known: {sorted(known)}")
    return SpeculativeConfig(**cfg.speculative)


# EngineConfig fields a recipe spells otherwise; the others are the recipe's keys of that name.
_RECIPE_KEYS = {"enable_prefix_caching": "prefix_caching", "lora": "lora_mode"}


def engine_config(cfg, engine_index: int = 0):
    """The rollout.EngineConfig of a recipe's engine; a combination it refuses is a ValueError
    that starts with the recipe keys its message names (prefix_caching, not
    enable_prefix_caching)."""
    from rollout import EngineConfig

    # Seeded per engine: unseeded requests draw their seeds from it, so engines sample
    # differently while the ranks of one draw alike, as they must.
    options = dict(kv_cache_tokens=cfg.kv_cache_tokens, kv_memory_fraction=cfg.kv_memory_fraction,
                   max_model_len=cfg.max_model_len, max_num_seqs=cfg.max_num_seqs,
                   dtype=cfg.dtype, enable_prefix_caching=cfg.prefix_caching,
                   cuda_graphs=cfg.cuda_graphs, speculative=speculative_config(cfg),
                   tensor_parallel_size=cfg.tensor_parallel_size,
                   max_staleness=cfg.max_staleness if cfg.partial_rollouts else None,
                   carried_kv=cfg.carried_kv,
                   lora=cfg.lora_mode, seed=cfg.seed + 1009 * engine_index)
    try:
        return EngineConfig(**options)
    except ValueError as e:
        keys = sorted(_RECIPE_KEYS.get(name, name) for name in options
                      if re.search(rf"\b{name}\b", str(e)))
        raise ValueError(f"{', '.join(keys) or 'engine'}: {e}") from None
