"""Model registry keyed by Hugging Face `config.model_type`."""

from __future__ import annotations

from .llama import LlamaForCausalLM

MODEL_REGISTRY = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": LlamaForCausalLM,
}


def model_class(config):
    kind = getattr(config, "model_type", None)
    if kind not in MODEL_REGISTRY:
        raise ValueError(f"model_type {kind!r} is not supported; supported: "
                         f"{sorted(MODEL_REGISTRY)}")
    return MODEL_REGISTRY[kind]
