"""The library configs that a recipe's dict-valued keys become: `speculative`
(rollout.spec.SpeculativeConfig) and `lora` (peft.LoraConfig), each raising ValueError naming
the bad key before any model is built."""

from __future__ import annotations

import dataclasses


def lora_config(cfg):
    """The peft.LoraConfig of `cfg.lora` (None without one); ValueError naming a bad key."""
    if cfg.lora is None:
        return None
    import peft

    known = {f.name for f in dataclasses.fields(peft.LoraConfig)}
    unknown = sorted(set(cfg.lora) - known)
    if unknown:
        raise ValueError(f"lora: unknown key(s) {unknown}; see peft.LoraConfig")
    options = {"task_type": "CAUSAL_LM", "lora_dropout": 0.0, **cfg.lora}
    # PEFT takes these unchecked and fails later, inside the model.
    r, alpha, dropout = options.get("r", 8), options.get("lora_alpha", 8), options["lora_dropout"]
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise ValueError(f"lora.r must be an int >= 1, got {r!r}")
    if not isinstance(alpha, (int, float)) or not alpha > 0:
        raise ValueError(f"lora.lora_alpha must be a number > 0, got {alpha!r}")
    if not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
        raise ValueError(f"lora.lora_dropout must be in [0, 1), got {dropout!r}")
    try:
        return peft.LoraConfig(**options)
    except (TypeError, ValueError) as e:
        raise ValueError(f"lora: {e}") from None


def speculative_config(cfg):
    if cfg.speculative is None:
        return None
    from rollout.spec import SpeculativeConfig

    known = {f.name for f in dataclasses.fields(SpeculativeConfig)}
    unknown = sorted(set(cfg.speculative) - known)
    if unknown:
        raise ValueError(f"speculative: unknown key(s) {unknown}; known: {sorted(known)}")
    return SpeculativeConfig(**cfg.speculative)
