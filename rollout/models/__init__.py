"""The model families, registered by Hugging Face `config.model_type` (see base.py for the
contract, docs/models.md "Adding a model family" for the steps)."""

from __future__ import annotations

from . import gemma2, gemma3, llama, mixtral, phi3, qwen2, qwen3, qwen3_moe
from .base import MODEL_REGISTRY, CausalLM


def model_class(config) -> type[CausalLM]:
    kind = getattr(config, "model_type", None)
    if kind not in MODEL_REGISTRY:
        raise ValueError(f"model_type {kind!r} is not supported; supported: "
                         f"{sorted(MODEL_REGISTRY)}")
    return MODEL_REGISTRY[kind]
